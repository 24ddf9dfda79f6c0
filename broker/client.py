"""Redis clients and the stream commands the services use, sync (scheduler, worker) and async
(triggerer). Replies are parsed in :mod:`broker.replies`; atomic multi-command changes are Lua
scripts in :mod:`broker.scripts`."""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import redis
import redis.asyncio
from redis.exceptions import RedisError, ResponseError
from sqlalchemy.exc import OperationalError

from broker import replies, scripts
from broker.replies import Entry
from broker.streams import Message, StreamKeys, to_fields

log = logging.getLogger("deferral.broker")

MIN_REDIS_VERSION = (6, 2, 2)
# Ids per renewal / hand-off call: bounded work per Redis call (about 6.5 µs per id renewed).
RENEW_BATCH = 1000
PENDING_PAGE = 100_000


class RedisVersionError(RuntimeError):
    pass


def _client_options() -> dict[str, Any]:
    # RESP2 pinned: reply shapes must not change with redis-py's default protocol.
    return {"protocol": 2, "decode_responses": False, "health_check_interval": 30}


def _strip_callbacks(client: redis.Redis | redis.asyncio.Redis) -> None:
    for command in replies.RAW_COMMANDS:
        client.response_callbacks.pop(command, None)


def check_version(info: Mapping[str, Any]) -> None:
    raw = info.get("redis_version", "0")
    version_text = raw.decode() if isinstance(raw, bytes) else str(raw)
    version = tuple(int(part) for part in version_text.split(".")[:3])
    if version < MIN_REDIS_VERSION:
        wanted = ".".join(map(str, MIN_REDIS_VERSION))
        raise RedisVersionError(f"Redis {version_text} is too old: deferral needs >= {wanted}")


def _is_busygroup(exc: ResponseError) -> bool:
    return str(exc).startswith("BUSYGROUP")


def _xreadgroup_args(
    group: str, consumer: str, streams: Mapping[str, str], count: int, block_ms: int | None
) -> list[Any]:
    args: list[Any] = ["XREADGROUP", "GROUP", group, consumer, "COUNT", count]
    if block_ms is not None:
        args += ["BLOCK", block_ms]
    return [*args, "STREAMS", *streams.keys(), *streams.values()]


def dead_letter_fields(entry: Entry, error: str, deliveries: int) -> dict[str, str]:
    """The original entry's fields plus where it came from, why it died and how often it was
    delivered. Undecodable bytes are replaced: a dead letter must never fail to be written."""
    fields = {
        k.decode(errors="replace"): v.decode(errors="replace") for k, v in entry.fields.items()
    }
    return {
        **fields,
        "source_stream": entry.stream,
        "source_id": entry.id,
        "error": error,
        "deliveries": str(deliveries),
    }


def _batches(ids: Sequence[str]) -> list[Sequence[str]]:
    return [ids[start : start + RENEW_BATCH] for start in range(0, len(ids), RENEW_BATCH)]


def _xautoclaim_args(
    stream: str, group: str, consumer: str, min_idle_ms: int, cursor: str, count: int
) -> list[Any]:
    return ["XAUTOCLAIM", stream, group, consumer, min_idle_ms, cursor, "COUNT", count]


def _flat(fields: Mapping[str, str]) -> list[str]:
    return [item for pair in fields.items() for item in pair]


class Broker:
    """Synchronous stream operations (scheduler, worker, CLI)."""

    def __init__(self, client: redis.Redis, keys: StreamKeys) -> None:
        _strip_callbacks(client)
        self.redis = client
        self.keys = keys
        self._publish_and_ack = client.register_script(scripts.PUBLISH_AND_ACK)
        self._ack_delete = client.register_script(scripts.ACK_DELETE)
        self._renew = client.register_script(scripts.RENEW_OWNED)

    @classmethod
    def from_url(cls, url: str, prefix: str) -> Broker:
        client = redis.Redis.from_url(url, **_client_options())
        check_version(client.info("server"))
        return cls(client, StreamKeys(prefix))

    def close(self) -> None:
        self.redis.close()

    def ensure_group(self, stream: str, group: str) -> None:
        try:
            self.redis.execute_command("XGROUP", "CREATE", stream, group, "0", "MKSTREAM")
        except ResponseError as exc:
            if not _is_busygroup(exc):
                raise

    def publish(self, stream: str, message: Message | Mapping[str, str]) -> str:
        fields = to_fields(message) if isinstance(message, Message) else message
        entry_id = self.redis.execute_command("XADD", stream, "*", *_flat(fields))
        return str(replies._text(entry_id))

    def publish_many(self, items: Sequence[tuple[str, Mapping[str, str]]]) -> None:
        with self.redis.pipeline(transaction=False) as pipe:
            for stream, fields in items:
                pipe.execute_command("XADD", stream, "*", *_flat(fields))
            pipe.execute()

    def read(
        self,
        group: str,
        consumer: str,
        streams: Mapping[str, str],
        *,
        count: int,
        block_ms: int | None = None,
    ) -> list[Entry]:
        """XREADGROUP; ``streams`` maps each key to ``>`` (new) or ``0`` (own pending)."""
        reply = self.redis.execute_command(
            *_xreadgroup_args(group, consumer, streams, count, block_ms)
        )
        return replies.parse_xreadgroup(reply)

    def ack_delete(self, stream: str, group: str, ids: Sequence[str]) -> int:
        """Acknowledge and delete finished entries, so streams stay bounded."""
        if not ids:
            return 0
        return int(self._ack_delete(keys=[stream], args=[group, *ids]))

    def publish_and_ack(
        self, entry: Entry, group: str, to_stream: str, fields: Mapping[str, str]
    ) -> None:
        """Atomically XADD ``fields`` to ``to_stream`` and XACK + XDEL ``entry``."""
        self._publish_and_ack(
            keys=[entry.stream, to_stream], args=[group, entry.id, *_flat(fields)]
        )

    def dead_letter(self, entry: Entry, group: str, error: str, deliveries: int = 1) -> None:
        """Move a bad entry to the dead-letter stream and retire it, atomically."""
        fields = dead_letter_fields(entry, error, deliveries)
        self.publish_and_ack(entry, group, self.keys.dead, fields)

    def renew(self, stream: str, group: str, consumer: str, ids: Sequence[str]) -> list[str]:
        """Renew the lease on ``ids``; return those still owned (the rest were taken over)."""
        owned: list[str] = []
        for batch in _batches(ids):
            owned += replies.parse_ids(self._renew(keys=[stream], args=[group, consumer, *batch]))
        return owned

    def claim_idle(
        self, stream: str, group: str, consumer: str, *, min_idle_ms: int, count: int
    ) -> list[tuple[Entry, str]]:
        """Take up to ``count`` entries idle longer than ``min_idle_ms`` (their owner is dead),
        each with the consumer that held it. XPENDING IDLE finds them with their owners; XCLAIM
        with the same min-idle takes them, so one renewed in between stays with its owner."""
        pending = self.redis.execute_command(
            "XPENDING", stream, group, "IDLE", min_idle_ms, "-", "+", count
        )
        owners = replies.parse_xpending_owners(pending)
        if not owners:
            return []
        reply = self.redis.execute_command("XCLAIM", stream, group, consumer, min_idle_ms, *owners)
        return [(entry, owners[entry.id]) for entry in replies.parse_xclaim(stream, reply)]

    def newest(self, stream: str) -> Entry | None:
        reply = self.redis.execute_command("XREVRANGE", stream, "+", "-", "COUNT", 1)
        entries = replies.parse_xrange(stream, reply)
        return entries[0] if entries else None

    def xrange(self, stream: str, count: int | None = None) -> list[Entry]:
        args: list[Any] = ["XRANGE", stream, "-", "+"]
        if count is not None:
            args += ["COUNT", count]
        return replies.parse_xrange(stream, self.redis.execute_command(*args))

    def pending(self, stream: str, group: str) -> replies.PendingSummary:
        return replies.parse_xpending_summary(self.redis.execute_command("XPENDING", stream, group))

    def groups(self, stream: str) -> list[dict[str, Any]]:
        try:
            return replies.parse_xinfo_groups(self.redis.execute_command("XINFO GROUPS", stream))
        except ResponseError:
            return []  # no such stream yet


def run_until_stopped(
    broker: Broker, stop: threading.Event, step: Callable[[], object], stream: str, group: str
) -> None:
    """Run a service's ``step`` until ``stop`` is set. Redis or Postgres unreachable, or the
    stream or group lost, pauses the loop for a second, recreates the group, and goes on."""
    while not stop.is_set():
        try:
            step()
        except (RedisError, OperationalError) as exc:
            log.warning("step failed: %s; retrying", exc)
            stop.wait(1.0)
            with contextlib.suppress(RedisError):
                broker.ensure_group(stream, group)


class AsyncBroker:
    """Asynchronous stream operations (triggerer)."""

    def __init__(self, client: redis.asyncio.Redis, keys: StreamKeys) -> None:
        _strip_callbacks(client)
        self.redis = client
        self.keys = keys
        self._publish_and_ack = client.register_script(scripts.PUBLISH_AND_ACK)
        self._ack_delete = client.register_script(scripts.ACK_DELETE)
        self._renew = client.register_script(scripts.RENEW_OWNED)

    @classmethod
    async def from_url(cls, url: str, prefix: str, max_connections: int = 32) -> AsyncBroker:
        # A blocking pool: a thousand triggers firing at once wait for a connection instead of
        # failing with "Too many connections".
        pool = redis.asyncio.BlockingConnectionPool.from_url(
            url, max_connections=max_connections, timeout=None, **_client_options()
        )
        client = redis.asyncio.Redis(connection_pool=pool)
        check_version(await client.info("server"))
        return cls(client, StreamKeys(prefix))

    async def close(self) -> None:
        await self.redis.aclose()

    async def ensure_group(self, stream: str, group: str) -> None:
        try:
            await self.redis.execute_command("XGROUP", "CREATE", stream, group, "0", "MKSTREAM")
        except ResponseError as exc:
            if not _is_busygroup(exc):
                raise

    async def publish(self, stream: str, message: Message) -> None:
        await self.redis.execute_command("XADD", stream, "*", *_flat(to_fields(message)))

    async def read(
        self,
        group: str,
        consumer: str,
        streams: Mapping[str, str],
        *,
        count: int,
        block_ms: int | None = None,
    ) -> list[Entry]:
        reply = await self.redis.execute_command(
            *_xreadgroup_args(group, consumer, streams, count, block_ms)
        )
        return replies.parse_xreadgroup(reply)

    async def publish_and_ack(
        self, entry: Entry, group: str, to_stream: str, fields: Mapping[str, str]
    ) -> None:
        await self._publish_and_ack(
            keys=[entry.stream, to_stream], args=[group, entry.id, *_flat(fields)]
        )

    async def ack_delete(self, stream: str, group: str, ids: Sequence[str]) -> int:
        if not ids:
            return 0
        return int(await self._ack_delete(keys=[stream], args=[group, *ids]))

    async def renew(self, stream: str, group: str, consumer: str, ids: Sequence[str]) -> list[str]:
        """Renew the lease on ``ids``; return those still owned (the rest were taken over)."""
        owned: list[str] = []
        for batch in _batches(ids):
            reply = await self._renew(keys=[stream], args=[group, consumer, *batch])
            owned += replies.parse_ids(reply)
        return owned

    async def autoclaim(
        self, stream: str, group: str, consumer: str, *, min_idle_ms: int, count: int
    ) -> list[Entry]:
        """Take up to ``count`` entries idle longer than ``min_idle_ms`` (their owner is dead),
        following the XAUTOCLAIM cursor until it returns to 0-0."""
        claimed: list[Entry] = []
        cursor = "0-0"
        while len(claimed) < count:
            args = _xautoclaim_args(
                stream, group, consumer, min_idle_ms, cursor, count - len(claimed)
            )
            result = replies.parse_xautoclaim(stream, await self.redis.execute_command(*args))
            claimed, cursor = claimed + result.entries, result.cursor
            if cursor == "0-0":
                break
        return claimed

    async def pending_ids(self, stream: str, group: str, consumer: str) -> list[str]:
        reply = await self.redis.execute_command(
            "XPENDING", stream, group, "-", "+", PENDING_PAGE, consumer
        )
        return replies.parse_xpending_ids(reply)

    async def hand_off(
        self, stream: str, group: str, consumer: str, ids: Sequence[str], *, idle_ms: int
    ) -> None:
        """Mark our entries idle for ``idle_ms`` so that peers take them over at once."""
        for batch in _batches(ids):
            await self.redis.execute_command(
                "XCLAIM", stream, group, consumer, 0, *batch, "IDLE", idle_ms, "JUSTID"
            )

    async def dead_letter(self, entry: Entry, group: str, error: str, deliveries: int = 1) -> None:
        fields = dead_letter_fields(entry, error, deliveries)
        await self.publish_and_ack(entry, group, self.keys.dead, fields)
