"""The Redis client and every stream command the project uses. Replies are parsed in
:mod:`broker.replies`; atomic multi-command changes are Lua scripts in :mod:`broker.scripts`.

One synchronous client serves every process: the scheduler and the worker call it from their
loop, the triggerer from worker threads (redis-py's client and pool are thread-safe).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import IntEnum
from typing import Any

import msgspec
import redis
from redis.exceptions import RedisError, ResponseError

from broker import replies, scripts, topology
from broker.replies import Entry
from broker.streams import (
    DEFAULT_QUEUE,
    MAX_DEAD_ERROR,
    MAX_DEAD_LABEL,
    MAX_KEPT_ENTRY_BYTES,
    MAX_KEPT_ENTRY_FIELDS,
    DeadEntry,
    DeadLetterMessage,
    Message,
    StreamKeys,
    one_line,
    signed_dead_letter,
    to_fields,
)
from deferral.runtime.crypto import Cipher, Purpose

log = logging.getLogger("deferral.broker")

MIN_REDIS_VERSION = (6, 2, 2)
# Ids per renewal / hand-off / presence call. A Lua call holds Redis for its whole run, and its
# cost grows with its ids: a thousand at once held every other client (an event on its way, a
# scheduler's read) too long; 250 bound that at the price of a round trip per 250.
BATCH = 250
# deferral:dead is trimmed to about this many entries (DEFERRAL_DEAD_LETTER_MAXLEN).
DEFAULT_DEAD_LETTER_MAXLEN = 100_000
# Entries per XPENDING call: a takeover check or a replay reads a pending list in pages this
# long, never a whole list (a crashed consumer may have left a hundred thousand) in one call.
PENDING_PAGE = 1_000
# A process names each queue stream it publishes to or reads in the registry set again at most
# this often (once it is there, a publish costs nothing more; a wiped Redis gets it back soon).
QUEUE_REGISTRY_EVERY_SEC = 60.0


class RedisSetupError(RuntimeError):
    """Redis cannot be used as configured (the message says why and what to do)."""


class ShardCountError(RedisSetupError):
    """DEFERRAL_STREAM_SHARDS differs from the count the prefix was started with."""


class RedisVersionError(RedisSetupError):
    pass


def _client_options() -> dict[str, Any]:
    # RESP2 pinned: reply shapes must not change with redis-py's default protocol.
    return {"protocol": 2, "decode_responses": False, "health_check_interval": 30}


def check_version(info: Mapping[str, Any]) -> None:
    raw = info.get("redis_version", "0")
    version_text = raw.decode() if isinstance(raw, bytes) else str(raw)
    version = tuple(int(part) for part in version_text.split(".")[:3])
    if version < MIN_REDIS_VERSION:
        wanted = ".".join(map(str, MIN_REDIS_VERSION))
        raise RedisVersionError(f"Redis {version_text} is too old: deferral needs >= {wanted}")


def dead_letter_message(
    cipher: Cipher, entry: Entry, error: str, deliveries: int, consumer: str
) -> DeadLetterMessage:
    """The dead letter of ``entry``: bounded clear fields, the original entry sealed. Its size is
    fixed whatever the entry held (thousands of fields, megabytes), and undecodable bytes are
    replaced: a dead letter must never fail to be written."""
    reason = one_line(error, MAX_DEAD_ERROR)
    size = sum(len(k) + len(v) for k, v in entry.fields.items())
    sealed = ""
    if len(entry.fields) <= MAX_KEPT_ENTRY_FIELDS and size <= MAX_KEPT_ENTRY_BYTES:
        fields = {
            k.decode(errors="replace"): v.decode(errors="replace") for k, v in entry.fields.items()
        }
        original = DeadEntry(entry.stream, entry.id, fields, reason, deliveries)
        sealed = cipher.encrypt(Purpose.DEAD_LETTER, msgspec.json.encode(original))
    else:
        reason = one_line(
            f"entry of {len(entry.fields)} fields and {size} bytes not kept: {reason}",
            MAX_DEAD_ERROR,
        )
    label = entry.fields.get(b"task", b"")[: MAX_DEAD_LABEL * 4].decode(errors="replace")
    message = DeadLetterMessage(
        source_stream=entry.stream,
        source_id=entry.id,
        error=reason,
        deliveries=str(deliveries),
        task=one_line(label, MAX_DEAD_LABEL),
        consumer=one_line(consumer, MAX_DEAD_LABEL),
        sealed=sealed,
    )
    return signed_dead_letter(cipher, message)


def _batches(items: Sequence[str]) -> list[Sequence[str]]:
    return [items[start : start + BATCH] for start in range(0, len(items), BATCH)]


def _flat(fields: Mapping[str, str]) -> list[str]:
    return [item for pair in fields.items() for item in pair]


class LeaseStatus(IntEnum):
    """What a renewal found for one held entry."""

    OWNED = 1
    TAKEN = 0  # pending under another consumer: it took the entry over
    GONE = -1  # in no pending list: retired by a peer, or lost with Redis's data


@dataclass(frozen=True)
class Redriven:
    """What :meth:`Broker.redrive_dead` did: ``status`` 1 published (``entry_id`` the new
    entry), 0 the dead letter was gone, -1 refused (``entry_id`` the entry in flight)."""

    status: int
    entry_id: str


@dataclass(frozen=True)
class Claimed:
    """An entry taken over from a consumer that stopped renewing it."""

    entry: Entry
    owner: str  # the consumer that held it
    deliveries: int  # times delivered before this claim


@dataclass(frozen=True)
class SuspectTaken:
    """What :meth:`Broker.take_suspect` did: ``claimed`` the entry (its ``deliveries`` those
    counted against it, this one included), or None with ``busy`` naming the consumer running
    the stream's suspect ('' when the entry moved or is no suspect any more)."""

    claimed: Claimed | None
    busy: str


@dataclass(frozen=True)
class GroupInfo:
    name: str
    pending: int  # delivered, not yet acknowledged
    lag: int | None  # not yet delivered (None where Redis cannot tell)


@dataclass(frozen=True)
class StreamInfo:
    stream: str
    length: int
    groups: tuple[GroupInfo, ...]


class Broker:
    """Stream operations on one Redis, under one key prefix."""

    def __init__(self, client: redis.Redis, keys: StreamKeys) -> None:
        topology.raw_replies(client, replies.RAW_COMMANDS)
        self.redis = client
        self.keys = keys
        self._publish = client.register_script(scripts.PUBLISH)
        self._redrive_dead = client.register_script(scripts.REDRIVE_DEAD)
        self._queues_named: dict[str, float] = {}  # queue stream -> when last named (monotonic)
        self._retire = client.register_script(scripts.RETIRE)
        self._hand_on = client.register_script(scripts.HAND_ON)
        self._renew = client.register_script(scripts.RENEW)
        self._take_suspect = client.register_script(scripts.TAKE_SUSPECT)
        self._suspect_holder = client.register_script(scripts.SUSPECT_HOLDER)
        self._present = client.register_script(scripts.PRESENT)
        self._reclaim = client.register_script(scripts.RECLAIM)
        self._delete_idle_consumers = client.register_script(scripts.DELETE_IDLE_CONSUMERS)

    @classmethod
    def from_url(
        cls,
        url: str,
        prefix: str,
        *,
        shards: int | None = None,
        max_connections: int = 64,
        check_shards: bool = True,
    ) -> Broker:
        """Connect and check the server version and the shard count (raises RedisError while
        Redis is down, ShardCountError if ``prefix`` was started with another count). ``url``
        may name a Redis Cluster or Sentinel (:mod:`broker.topology`); ``shards`` defaults to
        the URL's (:func:`deferral.runtime.redis_urls.default_stream_shards`)."""
        client = topology.client(url, _client_options(), max_connections=max_connections)
        broker = cls(client, StreamKeys.for_redis(prefix, url, shards))
        try:
            check_version(client.info("server"))
            if check_shards:
                broker.check_shards()
        except BaseException:
            client.close()
            raise
        return broker

    def recorded_shards(self) -> int | None:
        """The shard count recorded for this prefix (None before any service started)."""
        recorded = self.redis.get(self.keys.shard_count)
        return None if recorded is None else int(recorded)

    def check_shards(self) -> None:
        """Record this prefix's shard count if none is yet; ShardCountError if another is
        recorded (a trigger would then be looked for in the wrong shard's streams). SET NX, then
        GET: Redis 6.2 has no SET NX GET."""
        if self.redis.set(self.keys.shard_count, self.keys.shards, nx=True):
            return
        recorded = self.recorded_shards()
        if recorded is not None and recorded != self.keys.shards:
            raise ShardCountError(
                f"DEFERRAL_STREAM_SHARDS is {self.keys.shards} but the streams of "
                f"{self.keys.prefix!r} were started with {recorded}: set it to "
                f"{recorded}, or stop every service and run "
                f"`deferral reshard-streams --shards {self.keys.shards}`"
            )

    def close(self) -> None:
        self.redis.close()

    def ensure_group(self, stream: str, group: str) -> None:
        self._name_queues([stream])
        try:
            self.redis.execute_command("XGROUP", "CREATE", stream, group, "0", "MKSTREAM")
        except ResponseError as exc:
            if not str(exc).startswith("BUSYGROUP"):
                raise

    # -- adding entries ------------------------------------------------------------------------

    def _field_of(self, stream: str, fields: Mapping[str, str]) -> str:
        return self.keys.index_field(stream, fields)

    def publish(self, stream: str, message: Message | Mapping[str, str]) -> str:
        """XADD, recording the entry in the stream's in-flight index when it names work."""
        fields = to_fields(message) if isinstance(message, Message) else message
        self._name_queues([stream])
        field = self._field_of(stream, fields)
        if not field:
            return replies.text(self.redis.execute_command("XADD", stream, "*", *_flat(fields)))
        return replies.text(
            self._publish(keys=[stream, self.keys.inflight(stream)], args=[field, *_flat(fields)])
        )

    def publish_many(self, items: Sequence[tuple[str, Mapping[str, str]]]) -> None:
        """:meth:`publish` for many entries in one round trip."""
        if not items:
            return
        if len(items) == 1:
            # A pipeline with a script first asks SCRIPT EXISTS (a round trip more); one call
            # is EVALSHA alone. One resumed task's entry is on the fire -> SUCCESS path.
            self.publish(*items[0])
            return
        self._name_queues([stream for stream, _ in items])
        with self.redis.pipeline(transaction=False) as pipe:
            for stream, fields in items:
                field = self._field_of(stream, fields)
                if field:
                    self._piped(
                        pipe,
                        self._publish,
                        [stream, self.keys.inflight(stream)],
                        [field, *_flat(fields)],
                    )
                else:
                    pipe.execute_command("XADD", stream, "*", *_flat(fields))
            pipe.execute()

    def _name_queues(self, streams: Iterable[str]) -> None:
        """Add the queue streams among ``streams`` to the registry set :meth:`stream_keys` reads,
        so that no scrape scans the keyspace for them."""
        now = time.monotonic()
        due = {
            s
            for s in streams
            if (
                self.keys.is_queue(s)
                or (self.keys.is_triggers(s) and self.keys.queue_of_triggers(s) != DEFAULT_QUEUE)
            )
            and now - self._queues_named.get(s, -QUEUE_REGISTRY_EVERY_SEC)
            >= QUEUE_REGISTRY_EVERY_SEC
        }
        if due:
            self.redis.sadd(self.keys.queues, *sorted(due))
            self._queues_named.update(dict.fromkeys(due, now))

    # -- reading and retiring --------------------------------------------------------------------

    def read(
        self,
        group: str,
        consumer: str,
        streams: Mapping[str, str],
        *,
        count: int,
        block_ms: int | None = None,
    ) -> list[Entry]:
        """XREADGROUP; ``streams`` maps each key to ``>`` (new) or an id (own pending after it)."""
        args: list[Any] = ["XREADGROUP", "GROUP", group, consumer, "COUNT", count]
        if block_ms is not None:
            args += ["BLOCK", block_ms]
        args += ["STREAMS", *streams.keys(), *streams.values()]
        return replies.parse_xreadgroup(self.redis.execute_command(*args))

    def _entry_field(self, entry: Entry) -> str:
        fields = {
            k.decode(errors="replace"): v.decode(errors="replace") for k, v in entry.fields.items()
        }
        return self._field_of(entry.stream, fields)

    def retire(self, group: str, entries: Sequence[Entry]) -> int:
        """Acknowledge and delete finished entries (and their in-flight index fields), so
        streams stay bounded. Entries of several streams may be mixed."""
        retired = 0
        by_stream: dict[str, list[str]] = {}
        for entry in entries:
            by_stream.setdefault(entry.stream, []).extend([entry.id, self._entry_field(entry)])
        for stream, pairs in by_stream.items():
            for start in range(0, len(pairs), 2 * BATCH):
                args = [group, *pairs[start : start + 2 * BATCH]]
                keys = [stream, self.keys.inflight(stream), self.keys.started(stream)]
                retired += int(self._retire(keys=keys, args=args))
        return retired

    def hand_on(
        self,
        entry: Entry,
        group: str,
        to_stream: str,
        fields: Mapping[str, str],
        *,
        maxlen: int = 0,
    ) -> str:
        """Atomically publish ``fields`` to ``to_stream`` and retire ``entry``; ``maxlen`` > 0
        trims ``to_stream`` to about that many entries (only for a stream no group reads)."""
        return replies.text(
            self._hand_on(
                keys=self._hand_on_keys(entry, to_stream),
                args=self._hand_on_args(entry, group, to_stream, fields, maxlen),
            )
        )

    def hand_on_many(
        self,
        group: str,
        items: Sequence[tuple[Entry, str, Mapping[str, str]]],
        *,
        maxlen: int = 0,
    ) -> None:
        """:meth:`hand_on` for many entries in one round trip (each still atomic on its own)."""
        if not items:
            return
        if len(items) == 1:  # EVALSHA alone, without the pipeline's SCRIPT EXISTS
            entry, to_stream, fields = items[0]
            self.hand_on(entry, group, to_stream, fields, maxlen=maxlen)
            return
        with self.redis.pipeline(transaction=False) as pipe:
            for entry, to_stream, fields in items:
                self._piped(
                    pipe,
                    self._hand_on,
                    self._hand_on_keys(entry, to_stream),
                    self._hand_on_args(entry, group, to_stream, fields, maxlen),
                )
            pipe.execute()

    def _piped(self, pipe: Any, script: Any, keys: Sequence[str], args: Sequence[str]) -> None:
        """Queue ``script`` on ``pipe``. redis-py loads a pipeline's scripts first on one Redis;
        a cluster pipeline does not (a node that never saw a script, or a promoted replica,
        would answer NOSCRIPT, and a non-transactional pipeline cannot be replayed without
        publishing twice), so there the script's text goes with the call (EVAL)."""
        if self.keys.hash_tagged:
            pipe.execute_command("EVAL", script.script, len(keys), *keys, *args)
        else:
            script(keys=keys, args=args, client=pipe)

    def _hand_on_keys(self, entry: Entry, to_stream: str) -> list[str]:
        keys, source = self.keys, entry.stream
        return [
            source,
            keys.inflight(source),
            to_stream,
            keys.inflight(to_stream),
            keys.started(source),
        ]

    def _hand_on_args(
        self, entry: Entry, group: str, to_stream: str, fields: Mapping[str, str], maxlen: int = 0
    ) -> list[str]:
        new_field = self._field_of(to_stream, fields)
        return [group, entry.id, self._entry_field(entry), new_field, str(maxlen), *_flat(fields)]

    def dead_letter(
        self,
        entry: Entry,
        group: str,
        error: str,
        *,
        cipher: Cipher,
        consumer: str,
        deliveries: int = 1,
        maxlen: int = DEFAULT_DEAD_LETTER_MAXLEN,
    ) -> None:
        """Move a bad entry to the dead-letter stream (trimmed to about ``maxlen`` entries) and
        retire it, atomically."""
        letters = [(entry, error, deliveries)]
        self.dead_letter_many(group, letters, cipher=cipher, consumer=consumer, maxlen=maxlen)

    def dead_letter_many(
        self,
        group: str,
        letters: Sequence[tuple[Entry, str, int]],
        *,
        cipher: Cipher,
        consumer: str,
        maxlen: int = DEFAULT_DEAD_LETTER_MAXLEN,
    ) -> None:
        """:meth:`dead_letter` for many entries (entry, error, deliveries) of one group in one
        round trip, each still atomic on its own: a flood of junk costs a round trip per read,
        not per entry."""
        dead = self.keys.dead
        moves = [
            (entry, dead, to_fields(dead_letter_message(cipher, entry, error, count, consumer)))
            for entry, error, count in letters
        ]
        if not self.keys.hash_tagged:
            self.hand_on_many(group, moves, maxlen=maxlen)
            return
        # On a Redis Cluster deferral:dead is in a slot of its own, so no one call can write it
        # and retire the entry: the dead letters are written first, then the entries retired. A
        # crash between leaves an entry pending and it is dead-lettered again (two dead
        # letters, of which a re-drive publishes at most one), never lost.
        with self.redis.pipeline(transaction=False) as pipe:
            for _, _, fields in moves:
                pipe.execute_command("XADD", dead, "MAXLEN", "~", maxlen, "*", *_flat(fields))
            pipe.execute()
        self.retire(group, [entry for entry, _, _ in moves])

    # -- leases ----------------------------------------------------------------------------------

    def renew(
        self,
        stream: str,
        group: str,
        consumer: str,
        ids: Sequence[str],
        *,
        survivors: Sequence[str] = (),
        suspect: str = "",
        lease_ms: int = 0,
    ) -> dict[str, LeaseStatus]:
        """Renew the lease on ``ids`` and ``survivors`` (whose start evidence is also deleted:
        they ran a whole heartbeat without killing their consumer) and keep ``suspect`` (the
        entry id of the suspect claim this consumer holds, if any) for another ``lease_ms``; say
        for each id whether it is still ours."""
        status: dict[str, LeaseStatus] = {}
        proven = set(survivors)
        ordered = [*survivors, *(i for i in ids if i not in proven)]
        keys = [stream, self.keys.started(stream), self.keys.suspect(stream)]
        claim = f"{suspect} {consumer}" if suspect else ""
        for batch in _batches(ordered):
            n = sum(1 for i in batch if i in proven)
            args: list[str | int] = [group, consumer, n, claim, lease_ms, *batch]
            reply = self._renew(keys=keys, args=args)
            status.update(zip(batch, (LeaseStatus(int(s)) for s in reply), strict=True))
        return status

    def mark_started(self, stream: str, entry_ids: Sequence[str]) -> None:
        """Write the start evidence of entries about to run (none counted against them yet),
        before anything of theirs runs: a consumer that dies running them leaves them suspects."""
        for batch in _batches(entry_ids):
            self.redis.hset(self.keys.started(stream), mapping=dict.fromkeys(batch, 0))

    def started_counts(self, stream: str, entry_ids: Sequence[str]) -> dict[str, int]:
        """Entry id -> the deliveries counted against it, for those of ``entry_ids`` with start
        evidence (started and not yet survived a heartbeat: suspects if their holder died)."""
        if not entry_ids:
            return {}
        values = self.redis.hmget(self.keys.started(stream), list(entry_ids))
        found = {}
        for entry_id, value in zip(entry_ids, values, strict=True):
            if value is not None:
                try:
                    found[entry_id] = max(0, int(value))
                except ValueError:  # not ours: a count nobody wrote means nothing either way
                    found[entry_id] = 0
        return found

    def take_suspect(
        self,
        stream: str,
        group: str,
        consumer: str,
        suspect: replies.Pending,
        *,
        min_idle_ms: int,
        lease_ms: int,
    ) -> SuspectTaken:
        """Take the group's one suspect claim of ``stream`` and the ``suspect`` entry with it
        (it must still be pending under the consumer it was listed under, idle ``min_idle_ms``
        at least, and still a suspect); see :data:`scripts.TAKE_SUSPECT`."""
        keys = [stream, self.keys.started(stream), self.keys.suspect(stream)]
        args = [group, consumer, suspect.id, suspect.consumer, str(min_idle_ms), str(lease_ms)]
        reply = self._take_suspect(keys=keys, args=args)
        status = int(reply[0])
        if status == 1:
            entries = replies.parse_xclaim(stream, reply[2])
            claimed = Claimed(entries[0], suspect.consumer, int(reply[1])) if entries else None
            return SuspectTaken(claimed, "")
        return SuspectTaken(None, replies.text(reply[1]) if status == 0 else "")

    def suspect_holder(self, stream: str) -> str:
        """The consumer running ``stream``'s suspect now, or '' when the claim is free."""
        keys = [self.keys.started(stream), self.keys.suspect(stream)]
        return replies.text(self._suspect_holder(keys=keys))

    def idle_pending(
        self, stream: str, group: str, *, min_idle_ms: int, count: int, after: str | None = None
    ) -> list[replies.Pending]:
        """Up to ``count`` (at most :data:`PENDING_PAGE`) pending entries idle longer than
        ``min_idle_ms`` (their owner stopped renewing them), with their owner and delivery count
        (XAUTOCLAIM would hide both); ``after`` an id: only entries after it (the next page)."""
        if count <= 0:
            return []
        start = "-" if after is None else f"({after}"
        return replies.parse_xpending_extended(
            self.redis.execute_command(
                "XPENDING", stream, group, "IDLE", min_idle_ms, start, "+", min(count, PENDING_PAGE)
            )
        )

    def claim(
        self,
        stream: str,
        group: str,
        consumer: str,
        idle: Sequence[replies.Pending],
        *,
        min_idle_ms: int,
    ) -> list[Claimed]:
        """Take the ``idle`` entries (from :meth:`idle_pending`); XCLAIM with the same min-idle,
        so an entry renewed in between stays with its owner."""
        if not idle:
            return []
        reply = self.redis.execute_command(
            "XCLAIM", stream, group, consumer, min_idle_ms, *(p.id for p in idle)
        )
        by_id = {p.id: p for p in idle}
        claimed = []
        for entry in replies.parse_xclaim(stream, reply):
            before = by_id[entry.id]
            claimed.append(Claimed(entry, before.consumer, before.deliveries))
        return claimed

    def claim_idle(
        self, stream: str, group: str, consumer: str, *, min_idle_ms: int, count: int
    ) -> list[Claimed]:
        """:meth:`idle_pending` then :meth:`claim`: every idle entry found."""
        idle = self.idle_pending(stream, group, min_idle_ms=min_idle_ms, count=count)
        return self.claim(stream, group, consumer, idle, min_idle_ms=min_idle_ms)

    def own_pending(
        self,
        stream: str,
        group: str,
        consumer: str,
        *,
        start: str = "-",
        end: str = "+",
        count: int = PENDING_PAGE,
    ) -> list[replies.Pending]:
        """Up to ``count`` (at most :data:`PENDING_PAGE`) of ``consumer``'s pending entries
        between ``start`` and ``end`` (ids, inclusive; ``(id`` excludes it)."""
        return replies.parse_xpending_extended(
            self.redis.execute_command(
                "XPENDING", stream, group, start, end, min(count, PENDING_PAGE), consumer
            )
        )

    def all_own_pending(self, stream: str, group: str, consumer: str) -> list[replies.Pending]:
        """Every pending entry of ``consumer``, read page by page."""
        found: list[replies.Pending] = []
        start = "-"
        while page := self.own_pending(stream, group, consumer, start=start):
            found += page
            if len(page) < PENDING_PAGE:
                break
            start = f"({page[-1].id}"
        return found

    def owners_of(self, stream: str, group: str, ids: Sequence[str]) -> dict[str, replies.Pending]:
        """Entry id -> its pending item now (consumer, count); ids pending nowhere left out."""
        if not ids:
            return {}
        with self.redis.pipeline(transaction=False) as pipe:
            for entry_id in ids:
                pipe.execute_command("XPENDING", stream, group, entry_id, entry_id, 1)
            replies_ = pipe.execute()
        found = {}
        for reply in replies_:
            for item in replies.parse_xpending_extended(reply):
                found[item.id] = item
        return found

    def reclaim(
        self, stream: str, group: str, consumer: str, found: Sequence[tuple[str, str]]
    ) -> list[str]:
        """Take back (id, found under) entries still held by that name; returns the ids taken
        back."""
        taken: list[str] = []
        for start in range(0, len(found), BATCH):
            batch = found[start : start + BATCH]
            args: list[str] = [group, consumer]
            for entry_id, holder in batch:
                args += [entry_id, holder]
            reply = self._reclaim(keys=[stream], args=args)
            taken += [item[0] for item, ok in zip(batch, reply, strict=True) if int(ok)]
        return taken

    def consumers(self, stream: str, group: str) -> dict[str, int]:
        """The group's consumers and how many entries each has pending."""
        try:
            reply = self.redis.execute_command("XINFO CONSUMERS", stream, group)
        except ResponseError:
            return {}  # no such stream or group
        return {
            str(info["name"]): int(info["pending"]) for info in replies.parse_xinfo_groups(reply)
        }

    def delete_idle_consumers(self, stream: str, group: str, names: Sequence[str]) -> list[str]:
        """XGROUP DELCONSUMER each of ``names`` that has nothing pending (checked in the same
        call); returns those deleted."""
        deleted: list[str] = []
        for batch in _batches(names):
            reply = self._delete_idle_consumers(keys=[stream], args=[group, *batch])
            deleted += [name for name, ok in zip(batch, reply, strict=True) if int(ok)]
        return deleted

    def hand_off(
        self, stream: str, group: str, consumer: str, ids: Sequence[str], *, idle_ms: int
    ) -> None:
        """Mark our entries idle for ``idle_ms`` so that peers take them over at once."""
        for batch in _batches(ids):
            self.redis.execute_command(
                "XCLAIM", stream, group, consumer, 0, *batch, "IDLE", idle_ms, "JUSTID"
            )

    # -- reconciliation and inspection ------------------------------------------------------------

    def present(self, stream: str, index_fields: Sequence[str]) -> dict[str, bool]:
        """For each index field (a trigger id, a task instance id): is an entry carrying it in
        ``stream`` now?"""
        found: dict[str, bool] = {}
        for batch in _batches(index_fields):
            reply = self._present(keys=[stream, self.keys.inflight(stream)], args=list(batch))
            found.update(zip(batch, (bool(int(p)) for p in reply), strict=True))
        return found

    def triggers_present(self, queue_of: Mapping[str, str]) -> dict[str, bool]:
        """:meth:`present` of trigger ids, each in the triggers stream of its task's queue
        (``queue_of``: trigger id -> queue)."""
        by_stream: dict[str, list[str]] = {}
        for trigger_id, queue in queue_of.items():
            by_stream.setdefault(self.keys.trigger_stream(queue, trigger_id), []).append(trigger_id)
        return self._present_by_stream(by_stream)

    def events_present(self, trigger_ids: Sequence[str]) -> dict[str, bool]:
        """:meth:`present` of trigger ids, each in the events stream of its shard."""
        by_stream: dict[str, list[str]] = {}
        for trigger_id in trigger_ids:
            by_stream.setdefault(self.keys.events_for(trigger_id), []).append(trigger_id)
        return self._present_by_stream(by_stream)

    def _present_by_stream(self, by_stream: Mapping[str, Sequence[str]]) -> dict[str, bool]:
        found: dict[str, bool] = {}
        for stream, index_fields in by_stream.items():
            found.update(self.present(stream, index_fields))
        return found

    def newest(self, stream: str, count: int = 1, *, before: str | None = None) -> list[Entry]:
        """The ``count`` newest entries of ``stream`` (older than the id ``before``, if given),
        newest first."""
        end = "+" if before is None else f"({before}"
        reply = self.redis.execute_command("XREVRANGE", stream, end, "-", "COUNT", count)
        return replies.parse_xrange(stream, reply)

    def entry(self, stream: str, entry_id: str) -> Entry | None:
        """The entry ``entry_id`` of ``stream``, or None if it holds none."""
        reply = self.redis.execute_command("XRANGE", stream, entry_id, entry_id)
        found = replies.parse_xrange(stream, reply)
        return found[0] if found else None

    # -- dead letters (the operator's side: broker.deadletters) ----------------------------------

    def redrive_dead(
        self,
        dead_id: str,
        to_stream: str,
        fields: Mapping[str, str],
        *,
        also_not_in: Sequence[str] = (),
    ) -> Redriven:
        """Publish a dead letter's original ``fields`` to ``to_stream`` (in-flight index written)
        and delete the dead letter, atomically and only once: not if the dead letter is gone,
        nor while an entry for the same work is in ``to_stream`` or a stream of ``also_not_in``."""
        field = self._field_of(to_stream, fields)
        if not field:
            raise ValueError(f"an entry for {to_stream} names no work: it cannot be re-driven")
        apart = self.keys.hash_tagged  # deferral:dead is in a slot of its own
        keys = [to_stream if apart else self.keys.dead, to_stream, self.keys.inflight(to_stream)]
        for other in also_not_in:
            keys += [self.keys.inflight(other), other]
        if apart and self.entry(self.keys.dead, dead_id) is None:
            return Redriven(0, "")
        status, entry_id = self._redrive_dead(
            keys=keys, args=["" if apart else dead_id, field, *_flat(fields)]
        )
        if apart and int(status) == 1 and not self.drop_dead([dead_id])[dead_id]:
            log.warning("dead letter %s was re-driven twice at once", dead_id)
        return Redriven(int(status), replies.text(entry_id))

    def drop_dead(self, dead_ids: Sequence[str]) -> dict[str, bool]:
        """Delete dead letters; for each id, whether there was one."""
        with self.redis.pipeline(transaction=False) as pipe:
            for dead_id in dead_ids:
                pipe.execute_command("XDEL", self.keys.dead, dead_id)
            deleted = pipe.execute()
        return {i: bool(int(n)) for i, n in zip(dead_ids, deleted, strict=True)}

    def xrange(self, stream: str, count: int | None = None, *, start: str = "-") -> list[Entry]:
        """Entries of ``stream`` from ``start`` (an id, ``(id`` for after it), oldest first."""
        args: list[Any] = ["XRANGE", stream, start, "+"]
        if count is not None:
            args += ["COUNT", count]
        return replies.parse_xrange(stream, self.redis.execute_command(*args))

    def pending(self, stream: str, group: str) -> replies.PendingSummary:
        return replies.parse_xpending_summary(self.redis.execute_command("XPENDING", stream, group))

    def stream_keys(self) -> list[str]:
        """The default queue's triggers streams, the events streams (every shard's) and the dead
        stream, then every stream named in the registry set (by whoever published to or read a
        queue): one SMEMBERS of a set as small as the number of queues, never a scan of the
        keyspace (metrics scrapes call this)."""
        return [
            *self.keys.triggers_of(DEFAULT_QUEUE),
            *self.keys.all_events,
            self.keys.dead,
            *self._named_streams(),
        ]

    def _named_streams(self) -> list[str]:
        """The registry set's streams but the default queue's triggers streams."""
        named = {replies.text(key) for key in self.redis.smembers(self.keys.queues)}
        return sorted(named.difference(self.keys.triggers_of(DEFAULT_QUEUE)))

    def trigger_streams(self) -> list[str]:
        """Every triggers stream, each shard's: the default queue's, then those of each queue
        named in the registry set (a trigger queue's stream is named there when first published
        to or read)."""
        named = [s for s in self._named_streams() if self.keys.is_triggers(s)]
        queues = dict.fromkeys([DEFAULT_QUEUE, *map(self.keys.queue_of_triggers, named)])
        return [stream for queue in queues for stream in self.keys.triggers_of(queue)]

    def stream_stats(self) -> list[StreamInfo]:
        """Length and consumer groups (pending, lag) of each stream that exists."""
        found = []
        for key in self.stream_keys():
            if not self.redis.exists(key):
                continue
            groups = tuple(
                GroupInfo(
                    str(g["name"]),
                    int(g["pending"]),
                    None if g.get("lag") is None else int(str(g["lag"])),
                )
                for g in self.groups(key)
            )
            found.append(StreamInfo(key, int(self.redis.xlen(key)), groups))
        return found

    def groups(self, stream: str) -> list[dict[str, Any]]:
        try:
            return replies.parse_xinfo_groups(self.redis.execute_command("XINFO GROUPS", stream))
        except ResponseError:
            return []  # no such stream yet


def redis_location(url: str) -> str:
    """Where a Redis URL points, without credentials, for messages."""
    return topology.location(url)


def connect_when_up(
    url: str, prefix: str, stop: threading.Event, shards: int | None = None
) -> Broker | None:
    """Connect to Redis, waiting (one log line) while it is down; None if ``stop`` is set first.
    A Redis it cannot use (too old, another shard count) ends the process with one line."""
    delay, said = 0.5, False
    while not stop.is_set():
        try:
            broker = Broker.from_url(url, prefix, shards=shards)
        except RedisSetupError as exc:
            raise SystemExit(str(exc)) from None
        except RedisError as exc:
            if not said:
                log.warning(
                    "Redis at %s is unreachable (%s); waiting for it", redis_location(url), exc
                )
                said = True
            stop.wait(delay)
            delay = min(delay * 2, 5.0)
            continue
        if said:
            log.info("Redis at %s is up", redis_location(url))
        return broker
    return None
