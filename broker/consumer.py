"""The consumer core that the worker, the triggerer and the scheduler share.

A :class:`StreamConsumer` is one consumer-group member of one stream. It

- replays its own pending entries first (a restart under the same ``--name``), then reads new ones;
- holds a lease on every entry it was given until the service retires it: :meth:`renew`, called
  every heartbeat, resets their idle time with an owner-checked Lua call and reports the entries
  it lost, and whether a peer took them (TAKEN) or they vanished (GONE);
- takes over entries idle longer than 2.1 x heartbeat (:meth:`claim`), whose owner stopped;
- counts deliveries: an entry delivered more than ``DEFERRAL_MAX_DELIVERIES`` times without once
  being held for a whole heartbeat has killed every consumer that took it (:meth:`exhausted`); the
  service dead-letters it and fails its task instead of running it again. Counts are believed
  only as far as PostgreSQL's rows of the processes agree (see :mod:`broker.deliveries`), and
  suspects are taken over or replayed one at a time;
- dead-letters an entry over the size limits before the service sees it, and never lets a
  failure to dead-letter escape;
- is acknowledged only when the service retires it, after its database commit.

:func:`run_until_stopped` is the loop around a service's step: transient errors (servers down,
deadlocks) back off and retry; nothing is dead-lettered or failed for them.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass

from broker.client import BATCH, DEFAULT_DEAD_LETTER_MAXLEN, PENDING_PAGE, Broker, LeaseStatus
from broker.deliveries import (
    Candidate,
    OwnerRecord,
    OwnerRegistry,
    choose,
    judge_replay,
    judge_takeover,
    over_limits,
    prunable,
)
from broker.lease import Lease
from broker.replies import Entry, Pending
from broker.streams import MAX_DEAD_ERROR, one_line
from deferral.runtime import metrics
from deferral.runtime.crypto import Cipher
from deferral.runtime.faults import is_transient

log = logging.getLogger("deferral.broker")

# Pages of the pending list one takeover look reads at most (each PENDING_PAGE long).
TAKEOVER_PAGES = 10
# How often a consumer removes the group's consumers of processes that stopped.
PRUNE_CONSUMERS_EVERY_SEC = 60.0
# Entries remembered as held by unregistered names (see judge_takeover); forgotten past this.
UNREGISTERED_SEEN_MAX = 100_000
# The owner record assumed for everyone when no registry is given: counts believed.
BELIEVED = OwnerRecord(running=True, heartbeat_age_sec=float("inf"))


@dataclass(frozen=True)
class Delivery:
    entry: Entry
    deliveries: int  # times delivered, this one included
    # Who held it before: a peer that stopped renewing it (takeover), or this consumer's name
    # when an earlier process of that name left it pending (replay); None for a new entry.
    taken_from: str | None = None


@dataclass(frozen=True)
class Lost:
    entry_id: str
    status: LeaseStatus  # TAKEN or GONE


class StreamConsumer:
    def __init__(
        self,
        broker: Broker,
        stream: str,
        group: str,
        name: str,
        *,
        heartbeat_sec: float,
        max_deliveries: int,
        cipher: Cipher,
        dead_letter_maxlen: int = DEFAULT_DEAD_LETTER_MAXLEN,
        owners: OwnerRegistry | None = None,
    ) -> None:
        self.broker = broker
        self.cipher = cipher  # seals what goes to the dead letters
        self.dead_letter_maxlen = dead_letter_maxlen
        self.stream = stream
        metrics.show_stream(stream)
        self.group = group
        self.name = name
        self.heartbeat_sec = heartbeat_sec
        self.lease = Lease.of(heartbeat_sec)
        self.max_deliveries = max_deliveries
        # The processes' rows in PostgreSQL, which say whose delivery counts to believe; without
        # them (tests of the core alone) Redis's counts are believed.
        self.owners = owners
        self._held: dict[str, float] = {}  # entry id -> monotonic time it was delivered
        # Entries replayed or taken over and not yet held a whole heartbeat here: no suspect is
        # taken while any is left, so a suspect that kills us takes no unproven entry with it.
        self._unproven: set[str] = set()
        self._looked_back = False
        self._previous: OwnerRecord | None = None  # this name's row before this process
        self._replaying = True
        self._replay_cursor: str | None = "-"  # the next page of our own pending list
        # Our pending entries to replay next (their delivery count: the counted one).
        self._replay_ready: list[Pending] = []
        self._replay_suspects: list[Pending] = []  # replayed one at a time, at the end
        self._unregistered_seen: dict[str, float] = {}  # entry id -> first seen so held
        self._next_prune = time.monotonic() + PRUNE_CONSUMERS_EVERY_SEC
        self._lock = threading.Lock()  # the triggerer calls from several threads

    def start(self) -> None:
        """Create the group if needed (also after Redis lost it). The first call, before the
        service registers its process, also reads how the previous process of this name ended
        (its row), which says whether the delivery counts of the entries it left are believed."""
        self.broker.ensure_group(self.stream, self.group)
        if not self._looked_back:
            self._previous = self._owner_records([self.name]).get(self.name)
            self._looked_back = True

    @property
    def held(self) -> int:
        return len(self._held)

    def holds(self, entry_id: str) -> bool:
        return entry_id in self._held

    def _drop(self, ids: Sequence[str]) -> None:
        with self._lock:
            for entry_id in ids:
                self._held.pop(entry_id, None)
                self._unproven.discard(entry_id)

    def _owner_records(self, names: Collection[str]) -> Mapping[str, OwnerRecord]:
        if self.owners is None:
            return {name: BELIEVED for name in names}
        return self.owners.owners(names)

    def _admit(self, deliveries: Sequence[Delivery], *, unproven: bool) -> list[Delivery]:
        """Hold the deliveries the service may handle. Before anything reads their fields, an
        entry over the size limits is dead-lettered unread, and one deleted while pending (no
        fields) acknowledged: neither reaches the service."""
        now = time.monotonic()
        admitted: list[Delivery] = []
        oversized: list[tuple[Delivery, str]] = []
        gone: list[Entry] = []
        for delivery in deliveries:
            entry = delivery.entry
            if not entry.fields:
                gone.append(entry)
                continue
            with self._lock:
                self._held[entry.id] = now
                if unproven:
                    self._unproven.add(entry.id)
            reason = over_limits(entry.fields)
            if reason is not None:
                oversized.append((delivery, reason))
                continue
            admitted.append(delivery)
        self.dead_letter_many(oversized)
        if gone:
            self.retire(gone)
        return admitted

    # -- getting entries -------------------------------------------------------------------------

    def poll(self, count: int, block_ms: int | None = None) -> list[Delivery]:
        """Up to ``count`` entries: own pending ones first (left by an earlier process of this
        name), then new ones (blocking up to ``block_ms`` for them)."""
        if count <= 0:
            return []
        if self._replaying:
            replayed = self._replay(count)
            if replayed is not None:
                if not replayed and block_ms:
                    # Suspects are replayed one per heartbeat: wait a little, do not spin.
                    time.sleep(min(block_ms / 1000, self.heartbeat_sec / 4))
                return replayed
        entries = self.broker.read(
            self.group, self.name, {self.stream: ">"}, count=count, block_ms=block_ms
        )
        return self._admit([Delivery(entry, 1) for entry in entries], unproven=False)

    def _replay(self, count: int) -> list[Delivery] | None:
        """The next of our own pending entries (None once all are replayed). Like a takeover,
        and before any new entry is read: first every entry whose holder survived it or that is
        past the cap, then the suspects one at a time (see :func:`choose`)."""
        while not self._replay_ready and self._replay_cursor is not None:
            self._replay_page()
        if self._replay_ready:
            with self._lock:
                batch, self._replay_ready = self._replay_ready[:count], self._replay_ready[count:]
            return self._claim_own(batch)
        if not self._replay_suspects:
            self._replaying = False
            return None
        if not self._suspect_allowed():
            return []
        # A copy: the lease renewal (another thread, in the triggerer) may drop the chosen one
        # from the list meanwhile (a peer took it); the owner-checked claim below tells.
        with self._lock:
            suspects = list(self._replay_suspects)
        candidates = [Candidate(p.id, p.deliveries) for p in suspects]
        (chosen,) = choose(candidates, self.max_deliveries, suspect_allowed=True)
        suspect = next(p for p in suspects if p.id == chosen)
        with self._lock:
            self._replay_suspects = [p for p in self._replay_suspects if p.id != chosen]
        log.info(
            "%s: replaying suspect entry %s of %s alone (%d earlier deliveries died with it)",
            self.name,
            suspect.id,
            self.stream,
            suspect.deliveries,
        )
        return self._claim_own([suspect])

    def _replay_page(self) -> None:
        assert self._replay_cursor is not None
        page = self.broker.own_pending(
            self.stream, self.group, self.name, start=self._replay_cursor
        )
        self._replay_cursor = f"({page[-1].id}" if len(page) >= PENDING_PAGE else None
        candidates = []
        counted: list[Pending] = []
        distrusted: list[tuple[Pending, str]] = []
        for pending in page:
            if pending.id in self._held:
                continue
            judged = judge_replay(pending.deliveries, self._previous)
            if judged.distrusted:
                distrusted.append((pending, judged.distrusted))
            candidates.append(Candidate(pending.id, judged.counted))
            counted.append(Pending(pending.id, self.name, pending.idle_ms, judged.counted))
        self._say_distrusted(distrusted)
        take = set(choose(candidates, self.max_deliveries, suspect_allowed=False))
        with self._lock:
            self._replay_ready += [p for p in counted if p.id in take]
            self._replay_suspects += [p for p in counted if p.id not in take]
        if candidates:
            log.info(
                "%s: replaying %d entr(ies) of its own on %s (%d suspect(s) alone, last)",
                self.name,
                len(candidates),
                self.stream,
                len(candidates) - len(take),
            )

    def _claim_own(self, items: Sequence[Pending]) -> list[Delivery]:
        """XCLAIM our own pending ``items`` (with their counted deliveries) to read them again.
        An owner-checked renewal goes first: an entry a peer took over since it was listed stays
        with that peer (a bare XCLAIM would steal it back), and one in no pending list is gone.
        One still ours that XCLAIM does not return was deleted, and is acknowledged."""
        if not items:
            return []
        status = self.broker.renew(self.stream, self.group, self.name, [p.id for p in items])
        mine = [p for p in items if status.get(p.id) is LeaseStatus.OWNED]
        claimed = self.broker.claim(self.stream, self.group, self.name, mine, min_idle_ms=0)
        back = {c.entry.id for c in claimed}
        gone = [Entry(self.stream, p.id, {}) for p in mine if p.id not in back]
        if gone:
            self.broker.retire(self.group, gone)
        return self._admit(
            [Delivery(c.entry, c.deliveries + 1, self.name) for c in claimed], unproven=True
        )

    def claim(self, count: int) -> list[Delivery]:
        """Take over up to ``count`` entries whose owner stopped renewing them.

        The pending list is read in pages (:data:`PENDING_PAGE`, at most
        :data:`TAKEOVER_PAGES` per call). Each entry's delivery count is judged against its
        holder's row (:func:`judge_takeover`): believed only if that registered process died
        holding it. Entries whose holder survived them and entries past the cap are taken
        together; a suspect (deliveries that died with it) only alone, the least delivered
        first, once everything taken over before has survived a heartbeat here, so an entry that
        kills its consumer never drags the ones delivered with it to the dead letters."""
        if count <= 0:
            return []
        suspect_allowed = self._suspect_allowed()
        picked: list[Pending] = []
        after: str | None = None
        now = time.monotonic()
        for _ in range(TAKEOVER_PAGES):
            listed = self.broker.idle_pending(
                self.stream,
                self.group,
                min_idle_ms=self.lease.takeover_after_ms,
                count=PENDING_PAGE,
                after=after,
            )
            # Our own entries are the replay's while it lasts (suspects one at a time, their
            # counts judged by the earlier process's row): taken over here, this name's fresh
            # row would have their counts ignored and the suspects run together.
            page = [
                p
                for p in listed
                if p.id not in self._held and not (self._replaying and p.consumer == self.name)
            ]
            owners = self._owner_records({p.consumer for p in page}) if page else {}
            candidates: list[Candidate] = []
            distrusted: list[tuple[Pending, str]] = []
            counted: dict[str, Pending] = {}
            for pending in page:
                owner = owners.get(pending.consumer)
                first_seen = now
                if owner is None:
                    first_seen = self._unregistered_seen.setdefault(pending.id, now)
                judged = judge_takeover(
                    pending.deliveries,
                    pending.idle_ms,
                    pending.consumer,
                    owner,
                    heartbeat_sec=self.heartbeat_sec,
                    unregistered_for_sec=now - first_seen,
                )
                if judged.wait:
                    continue
                if judged.distrusted:
                    distrusted.append((pending, judged.distrusted))
                candidates.append(Candidate(pending.id, judged.counted))
                counted[pending.id] = Pending(
                    pending.id, pending.consumer, pending.idle_ms, judged.counted
                )
            chosen = choose(candidates, self.max_deliveries, suspect_allowed=suspect_allowed)
            if any(0 < counted[i].deliveries < self.max_deliveries for i in chosen):
                suspect_allowed = False
            taken = set(chosen)
            self._say_distrusted([(p, why) for p, why in distrusted if p.id in taken])
            picked += [counted[i] for i in chosen][: count - len(picked)]
            if len(picked) >= count or len(listed) < PENDING_PAGE:
                break
            after = listed[-1].id
        if len(self._unregistered_seen) > UNREGISTERED_SEEN_MAX:
            self._unregistered_seen.clear()
        claimed = self.broker.claim(
            self.stream, self.group, self.name, picked, min_idle_ms=self.lease.takeover_after_ms
        )
        for c in claimed:
            self._unregistered_seen.pop(c.entry.id, None)
        if claimed:
            owners_named = sorted({c.owner for c in claimed})
            metrics.LEASE_TAKEOVERS.labels(self.stream).inc(
                sum(1 for c in claimed if c.owner != self.name)
            )
            log.info(
                "%s took over %d entr(ies) of %s from %s",
                self.name,
                len(claimed),
                self.stream,
                ", ".join(owners_named),
            )
        return self._admit(
            [Delivery(c.entry, c.deliveries + 1, c.owner) for c in claimed], unproven=True
        )

    def _suspect_allowed(self) -> bool:
        """Whether every entry replayed or taken over here has survived a heartbeat (or left)."""
        with self._lock:
            self._unproven &= self._held.keys()
            return not self._unproven

    def _say_distrusted(self, distrusted: Sequence[tuple[Pending, str]]) -> None:
        """One line for the delivery counts Redis gave that are not believed."""
        if not distrusted:
            return
        first, why = distrusted[0]
        log.warning(
            "%s: ignoring the delivery count Redis gives for %d entr(ies) of %s, e.g. %s (count"
            " %d): %s",
            self.name,
            len(distrusted),
            self.stream,
            first.id,
            first.deliveries,
            why,
        )
        metrics.FORGED_COUNTS.labels(self.stream).inc(len(distrusted))

    def exhausted(self, delivery: Delivery) -> bool:
        return delivery.deliveries > self.max_deliveries

    def exhausted_reason(self, delivery: Delivery) -> str:
        return (
            f"delivered {delivery.deliveries} times, and each consumer that took it stopped before"
            f" finishing it (DEFERRAL_MAX_DELIVERIES={self.max_deliveries})"
        )

    # -- leases ----------------------------------------------------------------------------------

    def renew(self, via: Broker | None = None) -> list[Lost]:
        """Renew the lease on every held entry; return those no longer ours (no longer held).
        Entries held for a whole heartbeat have their delivery count reset to 0: they did not
        kill their consumer. An entry found under a name no process is registered under (a
        forged XCLAIM) is taken back, its count ignored. Own entries still waiting for their turn
        in a replay are renewed too (peers would otherwise take them over with the count of a
        restarted name, which looks alive, ignored) and forgotten if they are no longer ours.
        ``via``: a broker of the caller's own (the triggerer renews from a thread with its own
        connections, which no other work can hold up)."""
        now = time.monotonic()
        with self._lock:
            held = dict(self._held)
            queued = [
                p.id for p in (*self._replay_ready, *self._replay_suspects) if p.id not in held
            ]
        self._prune_now_and_then()
        if not held and not queued:
            return []
        survivors = [i for i, at in held.items() if now - at >= self.heartbeat_sec]
        status = (via or self.broker).renew(
            self.stream, self.group, self.name, [*held, *queued], survivors=survivors
        )
        waiting = {i: status.pop(i) for i in queued}
        if gone := {i for i, state in waiting.items() if state is not LeaseStatus.OWNED}:
            with self._lock:
                self._replay_ready = [p for p in self._replay_ready if p.id not in gone]
                self._replay_suspects = [p for p in self._replay_suspects if p.id not in gone]
        taken = [i for i, s in status.items() if s is LeaseStatus.TAKEN]
        if taken and self.owners is not None:
            try:
                back = self._take_back(taken[:BATCH], set(survivors))
            except Exception as exc:
                # Who holds them cannot be told now (PostgreSQL down): they are lost, as a
                # peer's takeover is; raising would keep them running here beside their holder
                # for as long as the failure lasts.
                log.warning(
                    "could not check who took %d entr(ies) of %s: %s",
                    len(taken),
                    self.stream,
                    one_line(str(exc), MAX_DEAD_ERROR),
                )
                back = []
            for entry_id in back:
                status[entry_id] = LeaseStatus.OWNED
        lost = [Lost(i, s) for i, s in status.items() if s is not LeaseStatus.OWNED]
        self._drop([item.entry_id for item in lost])
        with self._lock:
            self._unproven.difference_update(
                i for i in survivors if status.get(i) is LeaseStatus.OWNED
            )
        metrics.LEASE_RENEWALS.labels(self.stream).inc(len(status) - len(lost))
        return lost

    def _take_back(self, taken: Sequence[str], survivors: set[str]) -> list[str]:
        """Of entries found pending under another name, take back those under a name that is
        not a registered consumer: no process of ours took them."""
        holders = self.broker.owners_of(self.stream, self.group, taken)
        records = self._owner_records({p.consumer for p in holders.values()})
        forged = [p for p in holders.values() if p.consumer not in records]
        if not forged:
            return []
        back = self.broker.reclaim(
            self.stream,
            self.group,
            self.name,
            [(p.id, p.consumer, 0 if p.id in survivors else 1) for p in forged],
        )
        if back:
            first = forged[0]
            log.warning(
                "%s: %d held entr(ies) of %s were claimed by a name that is not a registered"
                " consumer, e.g. %s by %r (delivery count %d): taken back, the count ignored",
                self.name,
                len(back),
                self.stream,
                first.id,
                first.consumer,
                first.deliveries,
            )
            metrics.FORGED_COUNTS.labels(self.stream).inc(len(back))
        return back

    def hand_off(self) -> int:
        """On the way out: make all our pending entries look long idle, so peers take them at
        once instead of after the takeover delay."""
        ids = [p.id for p in self.broker.all_own_pending(self.stream, self.group, self.name)]
        self.broker.hand_off(
            self.stream, self.group, self.name, ids, idle_ms=self.lease.hand_off_idle_ms
        )
        return len(ids)

    # -- hygiene -----------------------------------------------------------------------------------

    def _prune_now_and_then(self) -> None:
        if self.owners is None or time.monotonic() < self._next_prune:
            return
        self._next_prune = time.monotonic() + PRUNE_CONSUMERS_EVERY_SEC
        try:
            self.prune_consumers()
        except Exception as exc:  # housekeeping: never worth failing a renewal for
            log.warning("could not remove stopped consumers of %s: %s", self.stream, exc)

    def prune_consumers(self) -> list[str]:
        """Delete the group's consumers whose process is not alive and that hold nothing (a
        stopped process's name would otherwise stay in the group for ever)."""
        consumers = self.broker.consumers(self.stream, self.group)
        owners = self._owner_records([n for n, pending in consumers.items() if pending == 0])
        names = prunable(consumers, owners, me=self.name, heartbeat_sec=self.heartbeat_sec)
        deleted = self.broker.delete_idle_consumers(self.stream, self.group, names)
        if deleted:
            log.info(
                "removed %d stopped consumer(s) from %s/%s", len(deleted), self.stream, self.group
            )
        return deleted

    # -- finishing entries -----------------------------------------------------------------------

    def retire(self, entries: Sequence[Entry]) -> None:
        """Acknowledge and delete entries whose work is committed."""
        if entries:
            self.broker.retire(self.group, entries)
            self._drop([e.id for e in entries])

    def release(self, entry_ids: Sequence[str]) -> None:
        """Stop renewing entries without retiring them (a peer holds or retires them)."""
        self._drop(entry_ids)

    def hand_on_many(self, items: Sequence[tuple[Entry, str, Mapping[str, str]]]) -> None:
        """Publish each entry's outcome to another stream and retire the entry, atomically."""
        if items:
            self.broker.hand_on_many(self.group, items)
            self._drop([entry.id for entry, _, _ in items])

    def dead_letter(self, delivery: Delivery, reason: str) -> bool:
        """Set an entry aside in the dead letters; whether that worked. A failure is logged in
        one line and never raised: the entry is released (no longer renewed), so it is taken
        over and set aside again after the takeover delay, and the service goes on."""
        return self.dead_letter_many([(delivery, reason)])

    def dead_letter_many(self, letters: Sequence[tuple[Delivery, str]]) -> bool:
        """:meth:`dead_letter` for the entries of a read, in one round trip."""
        if not letters:
            return True
        for delivery, reason in letters:
            log.error(
                "dead-lettering %s entry %s: %s",
                self.stream,
                delivery.entry.id,
                one_line(reason, MAX_DEAD_ERROR),
            )
        ids = [delivery.entry.id for delivery, _ in letters]
        try:
            self.broker.dead_letter_many(
                self.group,
                [(delivery.entry, reason, delivery.deliveries) for delivery, reason in letters],
                cipher=self.cipher,
                consumer=self.name,
                maxlen=self.dead_letter_maxlen,
            )
        except Exception as exc:
            log.error(
                "could not dead-letter %s entr%s %s (%s: %s); retried after the takeover delay",
                self.stream,
                "y" if len(ids) == 1 else "ies",
                ", ".join(ids[:3]) + (f" and {len(ids) - 3} more" if len(ids) > 3 else ""),
                type(exc).__name__,
                one_line(str(exc), MAX_DEAD_ERROR),
            )
            self._drop(ids)
            return False
        self._drop(ids)
        metrics.DEAD_LETTERS.labels(self.stream).inc(len(ids))
        return True


# While an outage lasts, how often its current error is logged again.
OUTAGE_REPEAT_SEC = 60.0


class Backoff:
    """Exponential delays for retrying after transient errors."""

    def __init__(self, first: float = 0.1, cap: float = 5.0) -> None:
        self.first, self.cap = first, cap
        self.current = first

    def next(self) -> float:
        delay = self.current
        self.current = min(self.current * 2, self.cap)
        return delay

    def reset(self) -> None:
        self.current = self.first


def run_until_stopped(
    stop: threading.Event,
    step: Callable[[], object],
    recover: Callable[[], object],
    *,
    once: bool = False,
    clock: Callable[[], float] = time.monotonic,
) -> bool:
    """Run a service's ``step`` until ``stop`` is set (or, with ``once``, until it has succeeded
    once; returns whether it did). A transient error (Redis or Postgres unreachable, a deadlock)
    backs off, calls ``recover`` (e.g. recreate a lost group) and goes on, saying so when the
    outage starts and again, with the error of the moment, every ``OUTAGE_REPEAT_SEC`` it lasts
    (an operator must see what a long outage is stuck on, not its first second only); any other
    error is logged with its traceback and backed off too: one bad loop must not stop the
    service."""
    backoff = Backoff()
    failing_since: float | None = None
    said_at = 0.0
    while not stop.is_set():
        try:
            step()
        except Exception as exc:
            now = clock()
            if is_transient(exc):
                if failing_since is None:
                    log.warning("servers unavailable (%s: %s); retrying", type(exc).__name__, exc)
                    said_at = now
                elif now - said_at >= OUTAGE_REPEAT_SEC:
                    log.warning(
                        "servers still unavailable after %.0f s (%s: %s); retrying",
                        now - failing_since,
                        type(exc).__name__,
                        exc,
                        exc_info=True,  # where the loop is stuck
                    )
                    said_at = now
            else:
                log.exception("unexpected error in the service loop; retrying")
            if failing_since is None:
                failing_since = now
            stop.wait(backoff.next())
            try:
                recover()
            except Exception as again:
                if not is_transient(again):
                    log.exception("recovering failed")
            continue
        if failing_since is not None:
            log.info("servers available again")
            failing_since = None
        backoff.reset()
        if once:
            return True
    return False
