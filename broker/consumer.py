"""The consumer core that the worker, the triggerer and the scheduler share.

A :class:`StreamConsumer` is one consumer-group member of one stream. It

- replays its own pending entries first (a restart under the same ``--name``), then reads new ones;
- holds a lease on every entry it was given until the service retires it: :meth:`renew`, called
  every heartbeat, resets their idle time with an owner-checked Lua call and reports the entries
  it lost, and whether a peer took them (TAKEN) or they vanished (GONE);
- takes over entries idle longer than 2.1 x heartbeat (:meth:`claim`), whose owner stopped;
- counts deliveries: an entry delivered more than ``DEFERRAL_MAX_DELIVERIES`` times without once
  being held for a whole heartbeat has killed every consumer that took it (:meth:`exhausted`); the
  service dead-letters it and fails its task instead of running it again;
- is acknowledged only when the service retires it, after its database commit.

:func:`run_until_stopped` is the loop around a service's step: transient errors (servers down,
deadlocks) back off and retry; nothing is dead-lettered or failed for them.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from broker.client import DEFAULT_DEAD_LETTER_MAXLEN, Broker, LeaseStatus
from broker.lease import Lease
from broker.replies import Entry
from broker.streams import MAX_DEAD_ERROR, one_line
from deferral import metrics
from deferral.crypto import Cipher
from deferral.faults import is_transient

log = logging.getLogger("deferral.broker")


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
    ) -> None:
        self.broker = broker
        self.cipher = cipher  # seals what goes to the dead letters
        self.dead_letter_maxlen = dead_letter_maxlen
        self.stream = stream
        self.group = group
        self.name = name
        self.heartbeat_sec = heartbeat_sec
        self.lease = Lease.of(heartbeat_sec)
        self.max_deliveries = max_deliveries
        self._held: dict[str, float] = {}  # entry id -> monotonic time it was delivered
        self._replay_after: str | None = "0-0"  # own pending history still to replay
        self._probation: str | None = None  # the suspect entry taken over last (see claim)
        self._lock = threading.Lock()  # the triggerer calls from several threads

    def start(self) -> None:
        """Create the group if needed (also after Redis lost it)."""
        self.broker.ensure_group(self.stream, self.group)

    @property
    def held(self) -> int:
        return len(self._held)

    def holds(self, entry_id: str) -> bool:
        return entry_id in self._held

    def _take(self, deliveries: list[Delivery]) -> list[Delivery]:
        now = time.monotonic()
        with self._lock:
            for delivery in deliveries:
                self._held[delivery.entry.id] = now
        return deliveries

    def _drop(self, ids: Sequence[str]) -> None:
        with self._lock:
            for entry_id in ids:
                self._held.pop(entry_id, None)

    # -- getting entries -------------------------------------------------------------------------

    def poll(self, count: int, block_ms: int | None = None) -> list[Delivery]:
        """Up to ``count`` entries: own pending ones first, then new ones (blocking up to
        ``block_ms`` for them)."""
        if count <= 0:
            return []
        if self._replay_after is not None:
            replayed = self._replay(count)
            if replayed:
                return replayed
        entries = self.broker.read(
            self.group, self.name, {self.stream: ">"}, count=count, block_ms=block_ms
        )
        return self._take([Delivery(entry, 1) for entry in entries])

    def _replay(self, count: int) -> list[Delivery]:
        """The next page of our own pending entries (left by an earlier process of this name)."""
        assert self._replay_after is not None
        entries = self.broker.read(
            self.group, self.name, {self.stream: self._replay_after}, count=count
        )
        if not entries:
            self._replay_after = None
            return []
        self._replay_after = entries[-1].id
        # Deleted while pending: nothing left to do but acknowledge.
        empty = [e for e in entries if not e.fields]
        if empty:
            self.broker.retire(self.group, empty)
        live = [e for e in entries if e.fields and e.id not in self._held]
        if not live:
            return self._replay(count)
        counts = {
            p.id: p.deliveries
            for p in self.broker.own_pending(
                self.stream, self.group, self.name, start=live[0].id, end=live[-1].id
            )
        }
        log.info("%s: replaying %d entr(ies) of its own on %s", self.name, len(live), self.stream)
        return self._take([Delivery(e, counts.get(e.id, 1), self.name) for e in live])

    def claim(self, count: int) -> list[Delivery]:
        """Take over up to ``count`` entries whose owner stopped renewing them.

        An entry whose owner died before holding it a whole heartbeat keeps its delivery count
        (renewals reset it): with a count above 1 it may be what killed its consumers, or only
        have shared their fate with one that did. Such suspects are taken one at a time, the
        least delivered first, and the next only once the last has survived a heartbeat here, so
        an entry that kills its consumer never drags the ones delivered with it to the dead
        letters. Entries seen for the first time since a death, and entries past the limit
        (dead-lettered without running), are taken together."""
        idle = self.broker.idle_pending(
            self.stream,
            self.group,
            min_idle_ms=self.lease.takeover_after_ms,
            count=count,
        )
        take = [p for p in idle if p.deliveries <= 1 or p.deliveries >= self.max_deliveries]
        suspects = sorted(
            (p for p in idle if 1 < p.deliveries < self.max_deliveries),
            key=lambda p: (p.deliveries, p.id),
        )
        if suspects and not self._on_probation():
            take.append(suspects[0])
            self._probation = suspects[0].id
        claimed = self.broker.claim(
            self.stream, self.group, self.name, take, min_idle_ms=self.lease.takeover_after_ms
        )
        if claimed:
            owners = sorted({c.owner for c in claimed})
            metrics.LEASE_TAKEOVERS.labels(self.stream).inc(
                sum(1 for c in claimed if c.owner != self.name)
            )
            log.info(
                "%s took over %d entr(ies) of %s from %s",
                self.name,
                len(claimed),
                self.stream,
                ", ".join(owners),
            )
        return self._take([Delivery(c.entry, c.deliveries + 1, c.owner) for c in claimed])

    def _on_probation(self) -> bool:
        """Whether the last suspect taken over is still held and not yet a heartbeat old."""
        if self._probation is None:
            return False
        delivered = self._held.get(self._probation)
        if delivered is None or time.monotonic() - delivered >= self.heartbeat_sec:
            self._probation = None
            return False
        return True

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
        Entries held for a whole heartbeat have their delivery count reset: they did not kill
        their consumer. ``via``: a broker of the caller's own (the triggerer renews from a
        thread with its own connections, which no other work can hold up)."""
        now = time.monotonic()
        with self._lock:
            held = dict(self._held)
        if not held:
            return []
        survivors = [i for i, at in held.items() if now - at >= self.heartbeat_sec]
        status = (via or self.broker).renew(
            self.stream, self.group, self.name, list(held), survivors=survivors
        )
        lost = [Lost(i, s) for i, s in status.items() if s is not LeaseStatus.OWNED]
        self._drop([item.entry_id for item in lost])
        metrics.LEASE_RENEWALS.labels(self.stream).inc(len(status) - len(lost))
        return lost

    def hand_off(self) -> int:
        """On the way out: make all our pending entries look long idle, so peers take them at
        once instead of after the takeover delay."""
        ids = [p.id for p in self.broker.own_pending(self.stream, self.group, self.name)]
        self.broker.hand_off(
            self.stream, self.group, self.name, ids, idle_ms=self.lease.hand_off_idle_ms
        )
        return len(ids)

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

    def dead_letter(self, delivery: Delivery, reason: str) -> None:
        log.error(
            "dead-lettering %s entry %s: %s",
            self.stream,
            delivery.entry.id,
            one_line(reason, MAX_DEAD_ERROR),
        )
        self.broker.dead_letter(
            delivery.entry,
            self.group,
            reason,
            cipher=self.cipher,
            consumer=self.name,
            deliveries=delivery.deliveries,
            maxlen=self.dead_letter_maxlen,
        )
        self._drop([delivery.entry.id])
        metrics.DEAD_LETTERS.labels(self.stream).inc()


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
) -> bool:
    """Run a service's ``step`` until ``stop`` is set (or, with ``once``, until it has succeeded
    once; returns whether it did). A transient error (Redis or Postgres unreachable, a deadlock)
    backs off, calls ``recover`` (e.g. recreate a lost group) and goes on, saying so once per
    outage; any other error is logged with its traceback and backed off too: one bad loop must
    not stop the service."""
    backoff = Backoff()
    failing = False
    while not stop.is_set():
        try:
            step()
        except Exception as exc:
            if is_transient(exc):
                if not failing:
                    log.warning("servers unavailable (%s: %s); retrying", type(exc).__name__, exc)
            else:
                log.exception("unexpected error in the service loop; retrying")
            failing = True
            stop.wait(backoff.next())
            try:
                recover()
            except Exception as again:
                if not is_transient(again):
                    log.exception("recovering failed")
            continue
        if failing:
            log.info("servers available again")
            failing = False
        backoff.reset()
        if once:
            return True
    return False
