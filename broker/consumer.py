"""The consumer core that the worker, the triggerer and the scheduler share.

A :class:`StreamConsumer` is one consumer-group member of one stream. It

- replays its own pending entries first (a restart under the same ``--name``), then reads new ones;
- holds a lease on every entry it was given until the service retires it: :meth:`renew`, called
  every heartbeat, resets their idle time with an owner-checked Lua call and reports the entries
  it lost, and whether a peer took them (TAKEN) or they vanished (GONE);
- takes over entries idle longer than 2.1 x heartbeat (:meth:`claim`), whose owner stopped;
- isolates suspects: the service's start of an entry is written down first (start evidence),
  and an entry whose consumer died while it stood is a suspect. Suspects run one at a time in the
  whole group (a claim per stream in Redis), each in a process that runs nothing else unproven,
  and an entry that killed ``DEFERRAL_MAX_DELIVERIES`` consumers so (:meth:`exhausted`) is
  dead-lettered and its task failed instead of running it again. Evidence is believed only as
  far as PostgreSQL's rows of the processes agree (see :mod:`broker.deliveries`);
- dead-letters an entry over the size limits before the service sees it, and never lets a
  failure to dead-letter escape;
- is acknowledged only when the service retires it, after its database commit.

:func:`run_until_stopped` is the loop around a service's step: transient errors (servers down,
deadlocks) back off and retry; nothing is dead-lettered or failed for them.
"""

from __future__ import annotations

import functools
import itertools
import logging
import threading
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass

from broker.client import BATCH, DEFAULT_DEAD_LETTER_MAXLEN, PENDING_PAGE, Broker, LeaseStatus
from broker.deliveries import (
    Candidate,
    Judged,
    OwnerRecord,
    OwnerRegistry,
    due_for_proof,
    id_key,
    judge_replay,
    judge_takeover,
    may_run_suspect,
    over_limits,
    prunable,
    sort_out,
)
from broker.heldids import HeldIds
from broker.lease import Lease
from broker.replies import Entry, Pending
from broker.streams import MAX_DEAD_ERROR, one_line
from deferral.runtime import metrics
from deferral.runtime.crypto import Cipher
from deferral.runtime.faults import is_transient
from deferral.runtime.outages import OUTAGE, Outage

log = logging.getLogger("deferral.broker")

# Pages of the pending list one takeover look reads at most (each PENDING_PAGE long).
TAKEOVER_PAGES = 10
# Suspects one takeover look tries to take, in order, when the first has moved meanwhile.
SUSPECT_TRIES = 3
# How often a consumer removes the group's consumers of processes that stopped.
PRUNE_CONSUMERS_EVERY_SEC = 60.0
# Held entries renewed per call of Broker.renew (which sends them BATCH at a time): the ids'
# strings exist a chunk at a time.
RENEW_CHUNK = 5_000
# Entries remembered as held by unregistered names (see judge_takeover); forgotten past this.
UNREGISTERED_SEEN_MAX = 100_000
# The owner record assumed for everyone when no registry is given: counts believed.
BELIEVED = OwnerRecord(running=True, heartbeat_age_sec=float("inf"))


@dataclass(frozen=True)
class Delivery:
    entry: Entry
    # Times delivered as far as the cap is concerned, this one included: 1 plus the deliveries
    # in which it was the one suspect running and its consumer died (see broker.deliveries).
    deliveries: int
    # Who held it before: a peer that stopped renewing it (takeover), or this consumer's name
    # when an earlier process of that name left it pending (replay); None for a new entry.
    taken_from: str | None = None
    suspect: bool = False  # run as the group's one suspect of its stream


@dataclass(frozen=True)
class Lost:
    """A held entry that a renewal found no longer ours. Entry ids are unique only within one
    stream (16 shard streams filled in one millisecond repeat ids): match it by ``key``."""

    stream: str
    entry_id: str
    status: LeaseStatus  # TAKEN or GONE

    @property
    def key(self) -> tuple[str, str]:
        return (self.stream, self.entry_id)


class Quarantine:
    """What one process has started that has not yet run a whole heartbeat, over all the streams
    it consumes, and the suspect it runs (at most one). A process takes a suspect only when it
    has nothing unproven, and starts nothing else while its suspect is unproven or while it
    waits to take one (it drains): whatever kills it then is the suspect. Shared by the
    :class:`StreamConsumer` s of a process (the triggerer calls them from several threads)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._unproven: dict[str, dict[str, float]] = {}  # stream -> entry id -> started at
        self.suspect: tuple[str, str] | None = None  # (stream, entry id)
        self._draining: set[str] = set()  # streams whose suspect waits for us to drain

    def started(self, stream: str, entry_ids: Sequence[str], *, suspect: bool = False) -> None:
        now = time.monotonic()
        with self._lock:
            of = self._unproven.setdefault(stream, {})
            for entry_id in entry_ids:
                of[entry_id] = now
            if suspect and entry_ids:
                self.suspect = (stream, entry_ids[0])
                self._draining.discard(stream)

    def due(self, stream: str, heartbeat_sec: float) -> list[str]:
        with self._lock:
            return due_for_proof(self._unproven.get(stream, {}), time.monotonic(), heartbeat_sec)

    def forget(self, stream: str, entry_ids: Collection[str]) -> None:
        """Entries proven, or no longer here (retired, released, lost)."""
        with self._lock:
            of = self._unproven.get(stream, {})
            for entry_id in entry_ids:
                of.pop(entry_id, None)
            if (
                self.suspect is not None
                and self.suspect[0] == stream
                and self.suspect[1] in entry_ids
            ):
                self.suspect = None

    def running(self, stream: str) -> str:
        """The entry id of the suspect this process runs on ``stream`` ('' for none)."""
        suspect = self.suspect
        return suspect[1] if suspect is not None and suspect[0] == stream else ""

    def may_run_suspect(self) -> bool:
        with self._lock:
            unproven = sum(len(of) for of in self._unproven.values())
            return may_run_suspect(self.suspect is not None, unproven)

    def drain_for(self, stream: str, draining: bool) -> None:
        with self._lock:
            if draining:
                self._draining.add(stream)
            else:
                self._draining.discard(stream)

    @property
    def quiet(self) -> bool:
        """Start nothing new: a suspect runs here, or waits for what runs here to prove itself."""
        return self.suspect is not None or bool(self._draining)


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
        quarantine: Quarantine | None = None,
        starts_on_admit: bool = True,
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
        # The processes' rows in PostgreSQL, which say whose start evidence to believe; without
        # them (tests of the core alone) it is believed.
        self.owners = owners
        # The process's unproven entries and suspect, over all its streams.
        self.quarantine = quarantine or Quarantine()
        # Whether every entry handed to the service starts running at once (worker, scheduler);
        # the triggerer says which it starts (:meth:`starting`): a timer runs no code of its own.
        self.starts_on_admit = starts_on_admit
        self._held = HeldIds()  # the ids of the entries held
        self._looked_back = False
        self._previous: OwnerRecord | None = None  # this name's row before this process
        self._replaying = True
        self._replay_cursor: str | None = "-"  # the next page of our own pending list
        # Our pending entries to replay next, and the suspects among them (replayed one at a
        # time, at the end, least counted first), with their judged counts.
        self._replay_ready: list[Pending] = []
        # Read but not handed over (a write of _admit refused): handed over at the next poll.
        self._unadmitted: list[Delivery] = []
        self._replay_suspects: list[Pending] = []
        self._unregistered_seen: dict[str, float] = {}  # entry id -> first seen so held
        # Where the next takeover look goes on in the pending list (None: from its start): the
        # entries before it were just taken and renewed, and XPENDING IDLE would scan past them
        # again at every call of a look (quadratic in a dead peer's hundred thousand).
        self._takeover_after: str | None = None
        self._next_prune = time.monotonic() + PRUNE_CONSUMERS_EVERY_SEC
        self._lock = threading.Lock()  # the triggerer calls from several threads

    def start(self) -> None:
        """Create the group if needed (also after Redis lost it). The first call, before the
        service registers its process, also reads how the previous process of this name ended
        (its row), which says whether the start evidence of the entries it left is believed,
        and lists and renews those entries: once this process registers, its name's row looks
        alive, and a peer taking them over would have to ignore their evidence."""
        self.broker.ensure_group(self.stream, self.group)
        if not self._looked_back:
            self._previous = self._owner_records([self.name]).get(self.name)
            self._looked_back = True
        while self._replay_cursor is not None:
            self._replay_page()

    @property
    def held(self) -> int:
        return len(self._held)

    @property
    def replaying(self) -> bool:
        """Whether own pending entries (an earlier process of this name's) are still to be
        handed over by :meth:`poll` before any new one is read."""
        return self._replaying

    def holds(self, entry_id: str) -> bool:
        return entry_id in self._held

    def _drop(self, ids: Sequence[str]) -> None:
        with self._lock:
            for entry_id in ids:
                self._held.discard(entry_id)
        self.quarantine.forget(self.stream, set(ids))

    def _owner_records(self, names: Collection[str]) -> Mapping[str, OwnerRecord]:
        if self.owners is None:
            return {name: BELIEVED for name in names}
        return self.owners.owners(names)

    def _admit(self, deliveries: Sequence[Delivery]) -> list[Delivery]:
        """Hold the deliveries the service may handle. Before anything reads their fields, an
        entry over the size limits is dead-lettered unread, and one deleted while pending (no
        fields) acknowledged: neither reaches the service. With ``starts_on_admit`` the start
        evidence of the others is written before they are handed over."""
        admitted: list[Delivery] = []
        oversized: list[tuple[Delivery, str]] = []
        gone: list[Entry] = []
        for delivery in deliveries:
            entry = delivery.entry
            if not entry.fields:
                gone.append(entry)
                continue
            with self._lock:
                self._held.add(entry.id)
            reason = over_limits(entry.fields)
            if reason is not None:
                oversized.append((delivery, reason))
                continue
            admitted.append(delivery)
        try:
            self.dead_letter_many(oversized)
            if gone:
                self.retire(gone)
            if self.starts_on_admit:
                self.starting(admitted)
        except Exception:
            # Read but not handed over (a write refused: Redis full, or gone since the read):
            # admitted again at the next poll. Forgotten, they would stay pending to this
            # process, renewed by it, and never run.
            self._unadmitted = list(deliveries)
            raise
        return admitted

    def starting(self, deliveries: Sequence[Delivery]) -> None:
        """Write the start evidence of entries about to run (one round trip), before anything of
        theirs runs. A suspect's was written when it was taken (with its count)."""
        ids = [d.entry.id for d in deliveries if not d.suspect]
        if ids:
            self.broker.mark_started(self.stream, ids)
            self.quarantine.started(self.stream, ids)

    # -- getting entries -------------------------------------------------------------------------

    def poll(self, count: int, block_ms: int | None = None) -> list[Delivery]:
        """Up to ``count`` entries: those read before and not handed over (a write refused), own
        pending ones (left by an earlier process of this name), then new ones (blocking up to
        ``block_ms`` for them). None while this process runs a suspect or drains to take one."""
        if count <= 0:
            return []
        if self._unadmitted:
            deliveries, self._unadmitted = self._unadmitted, []
            return self._admit(deliveries)
        if self._replaying:
            replayed = self._replay(count)
            if replayed is not None:
                if not replayed and block_ms:
                    # Suspects are replayed one at a time: wait a little, do not spin.
                    time.sleep(min(block_ms / 1000, self.heartbeat_sec / 4))
                return replayed
        if self._suspect_in_play():
            if block_ms:
                time.sleep(min(block_ms / 1000, self.heartbeat_sec / 4))
            return []
        entries = self.broker.read(
            self.group, self.name, {self.stream: ">"}, count=count, block_ms=block_ms
        )
        return self._admit([Delivery(entry, 1) for entry in entries])

    def _suspect_in_play(self) -> bool:
        """Whether this process must start nothing new now (its suspect has not yet run a whole
        heartbeat, or it drains to take one); proves what is due first, which may end that."""
        if not self.quarantine.quiet:
            return False
        self._prove_due()
        return self.quarantine.quiet

    def _prove_due(self) -> None:
        """Delete the start evidence of what has run here a whole heartbeat since it started
        (the lease renewal does so too, but only once a heartbeat: a suspect's claim is freed
        for the next suspect sooner this way)."""
        due = [i for i in self.quarantine.due(self.stream, self.heartbeat_sec) if i in self._held]
        if not due:
            return
        status = self.broker.renew(
            self.stream,
            self.group,
            self.name,
            due,
            survivors=due,
            suspect=self.quarantine.running(self.stream),
            lease_ms=self.lease.takeover_after_ms,
        )
        # Entries no longer ours are left to the lease renewal, which reports them lost.
        self.quarantine.forget(
            self.stream, {i for i, s in status.items() if s is LeaseStatus.OWNED}
        )

    def _replay(self, count: int) -> list[Delivery] | None:
        """The next of our own pending entries (None once all are replayed). Like a takeover,
        and before any new entry is read: first every entry that is no suspect or is past the
        cap, then the suspects one at a time, each under the group's suspect claim."""
        while not self._replay_ready and self._replay_cursor is not None:
            self._replay_page()
        if self._replay_ready:
            with self._lock:
                batch, self._replay_ready = self._replay_ready[:count], self._replay_ready[count:]
            return self._claim_own(batch)
        if not self._replay_suspects:
            self._replaying = False
            self.quarantine.drain_for(self.stream, False)
            return None
        if self.quarantine.suspect is not None:
            self._prove_due()
        if not self.quarantine.may_run_suspect():
            self.quarantine.drain_for(self.stream, True)
            return []
        # A copy: the lease renewal (another thread, in the triggerer) may drop one from the
        # list meanwhile (a peer took it); the owner-checked claim below tells.
        with self._lock:
            suspect = self._replay_suspects[0] if self._replay_suspects else None
        if suspect is None:
            return []
        taken = self._take_suspect(suspect, min_idle_ms=0)
        if taken is None:
            return []
        with self._lock:
            self._replay_suspects = [p for p in self._replay_suspects if p.id != suspect.id]
        if taken:
            log.info(
                "%s: replaying suspect entry %s of %s alone (%d earlier deliveries counted)",
                self.name,
                suspect.id,
                self.stream,
                suspect.deliveries,
            )
            return taken
        # No suspect any more (its evidence gone) or no longer ours: replayed as any other.
        return self._claim_own([Pending(suspect.id, self.name, suspect.idle_ms, 0)])

    def _take_suspect(self, suspect: Pending, *, min_idle_ms: int) -> list[Delivery] | None:
        """Take the group's suspect claim of this stream and ``suspect`` with it: the delivery,
        [] if the entry moved or is no suspect any more, None while another consumer runs a
        suspect of this stream."""
        outcome = self.broker.take_suspect(
            self.stream,
            self.group,
            self.name,
            suspect,
            min_idle_ms=min_idle_ms,
            lease_ms=self.lease.takeover_after_ms,
        )
        if outcome.busy:
            self.quarantine.drain_for(self.stream, False)
            return None
        if outcome.claimed is None:
            return []
        claimed = outcome.claimed
        self.quarantine.started(self.stream, [claimed.entry.id], suspect=True)
        if claimed.owner != self.name:
            metrics.LEASE_TAKEOVERS.labels(self.stream).inc()
            log.info(
                "%s took over suspect entry %s of %s from %s alone (%d earlier deliveries counted)",
                self.name,
                claimed.entry.id,
                self.stream,
                claimed.owner,
                claimed.deliveries - 1,
            )
        return self._admit(
            [Delivery(claimed.entry, claimed.deliveries, claimed.owner, suspect=True)]
        )

    def _judged_page(
        self, page: Sequence[Pending], judge: Callable[[Pending, int | None], Judged | None]
    ) -> tuple[list[Candidate], dict[str, Pending]]:
        """Judge a page of pending entries with their start evidence: the candidates (entries
        to leave for now left out) and each one's pending item with its counted deliveries."""
        started = self.broker.started_counts(self.stream, [p.id for p in page])
        candidates: list[Candidate] = []
        counted: dict[str, Pending] = {}
        distrusted: list[tuple[Pending, str]] = []
        for pending in page:
            evidence = started.get(pending.id)
            judged = judge(pending, evidence)
            if judged is None or judged.wait:
                continue
            if judged.distrusted:
                distrusted.append(
                    (Pending(pending.id, pending.consumer, 0, evidence or 0), judged.distrusted)
                )
            candidates.append(Candidate(pending.id, judged))
            counted[pending.id] = Pending(
                pending.id, pending.consumer, pending.idle_ms, judged.counted
            )
        self._say_distrusted(distrusted)
        return candidates, counted

    def _replay_page(self) -> None:
        assert self._replay_cursor is not None
        page = self.broker.own_pending(
            self.stream, self.group, self.name, start=self._replay_cursor
        )
        self._replay_cursor = f"({page[-1].id}" if len(page) >= PENDING_PAGE else None
        listed = [p.id for p in page if p.id not in self._held]
        status = self.broker.renew(self.stream, self.group, self.name, listed) if listed else {}
        fresh = [p for p in page if status.get(p.id) is LeaseStatus.OWNED]
        candidates, counted = self._judged_page(
            fresh, lambda _, started: judge_replay(started, self._previous)
        )
        sorted_out = sort_out(candidates, self.max_deliveries)
        with self._lock:
            self._replay_ready += [counted[i] for i in sorted_out.free]
            self._replay_suspects += [counted[i] for i in sorted_out.suspects]
            self._replay_suspects.sort(key=lambda p: (p.deliveries, id_key(p.id)))
        if candidates:
            log.info(
                "%s: replaying %d entr(ies) of its own on %s (%d suspect(s) alone, last)",
                self.name,
                len(candidates),
                self.stream,
                len(sorted_out.suspects),
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
        return self._admit([Delivery(c.entry, c.deliveries + 1, self.name) for c in claimed])

    def claim(self, count: int) -> list[Delivery]:
        """Take over up to ``count`` entries whose owner stopped renewing them.

        The pending list is read in pages as long as ``count`` (at most :data:`PENDING_PAGE`;
        at most :data:`TAKEOVER_PAGES` full pages' worth per call), going on where the last
        call of a look stopped. Each entry's start evidence is judged against its
        holder's row (:func:`judge_takeover`): believed only if that registered process died
        holding it. Entries that are no suspects (and those past the cap) are taken together.
        Only when there are none is a suspect taken, alone, under the group's suspect claim,
        by a process that runs nothing unproven: one that does stops starting anything new
        until it does not (it drains), unless another consumer runs a suspect of this stream.
        A process running a suspect takes nothing, so an entry that kills its consumer never
        takes others to the dead letters with it."""
        if count <= 0:
            return []
        if self._suspect_in_play() and self.quarantine.suspect is not None:
            return []  # nothing starts here beside a suspect
        free: list[Pending] = []
        suspects: list[Pending] = []
        after, self._takeover_after = self._takeover_after, None
        now = time.monotonic()
        # Pages as long as the entries wanted (up to PENDING_PAGE): each listed entry is judged
        # with its holder's row and evidence, so a page ten times the batch costs ten times.
        page_size = min(PENDING_PAGE, count)
        for _ in range(TAKEOVER_PAGES * PENDING_PAGE // page_size):
            listed = self.broker.idle_pending(
                self.stream,
                self.group,
                min_idle_ms=self.lease.takeover_after_ms,
                count=page_size,
                after=after,
            )
            # Our own entries are the replay's while it lasts (suspects one at a time, their
            # evidence judged by the earlier process's row): taken over here, this name's fresh
            # row would have their evidence ignored and the suspects run together.
            page = [
                p
                for p in listed
                if p.id not in self._held and not (self._replaying and p.consumer == self.name)
            ]
            owners = self._owner_records({p.consumer for p in page}) if page else {}
            judge = functools.partial(self._judge_takeover, owners, now)
            candidates, counted = self._judged_page(page, judge)
            sorted_out = sort_out(candidates, self.max_deliveries)
            free += [counted[i] for i in sorted_out.free][: count - len(free)]
            suspects += [counted[i] for i in sorted_out.suspects]
            if len(free) >= count:
                self._takeover_after = free[-1].id  # the rest of this page comes next
                break
            if len(listed) < page_size:
                break  # the end: the next look starts again from the start
            after = self._takeover_after = listed[-1].id
        if len(self._unregistered_seen) > UNREGISTERED_SEEN_MAX:
            self._unregistered_seen.clear()
        if free:
            self.quarantine.drain_for(self.stream, False)
            if self.quarantine.quiet:
                return []
            return self._take_over(free)
        if not suspects:
            self.quarantine.drain_for(self.stream, False)
            return []
        return self._take_over_suspect(suspects)

    def _judge_takeover(
        self,
        owners: Mapping[str, OwnerRecord],
        now: float,
        pending: Pending,
        started: int | None,
    ) -> Judged:
        owner = owners.get(pending.consumer)
        first_seen = now
        if owner is None:
            first_seen = self._unregistered_seen.setdefault(pending.id, now)
        return judge_takeover(
            started,
            pending.idle_ms,
            pending.consumer,
            owner,
            heartbeat_sec=self.heartbeat_sec,
            unregistered_for_sec=now - first_seen,
        )

    def _take_over(self, picked: Sequence[Pending]) -> list[Delivery]:
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
        counted = {p.id: p.deliveries for p in picked}
        return self._admit([Delivery(c.entry, counted[c.entry.id] + 1, c.owner) for c in claimed])

    def _take_over_suspect(self, suspects: Sequence[Pending]) -> list[Delivery]:
        """The first of ``suspects`` (least counted) that can be taken, if this process may run
        a suspect now; else it drains, unless another consumer runs this stream's suspect."""
        if not self.quarantine.may_run_suspect():
            holder = self.broker.suspect_holder(self.stream)
            self.quarantine.drain_for(self.stream, holder in ("", self.name))
            return []
        for suspect in suspects[:SUSPECT_TRIES]:
            taken = self._take_suspect(suspect, min_idle_ms=self.lease.takeover_after_ms)
            if taken is None:
                return []  # another consumer runs one
            if taken:
                self._unregistered_seen.pop(suspect.id, None)
                return taken
        return []

    def _say_distrusted(self, distrusted: Sequence[tuple[Pending, str]]) -> None:
        """One line for the start evidence found in Redis that is not believed."""
        if not distrusted:
            return
        first, why = distrusted[0]
        log.warning(
            "%s: ignoring the start evidence Redis gives for %d entr(ies) of %s, e.g. %s (count"
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
            f"delivered {delivery.deliveries} times, and each of the"
            f" {delivery.deliveries - 1} consumers that ran it alone as a suspect stopped before"
            f" finishing it (DEFERRAL_MAX_DELIVERIES={self.max_deliveries})"
        )

    # -- leases ----------------------------------------------------------------------------------

    def renew(self, via: Broker | None = None) -> list[Lost]:
        """Renew the lease on every held entry; return those no longer ours (no longer held).
        Entries that ran here a whole heartbeat since they started lose their start evidence:
        they did not kill their consumer (a suspect's claim ends with it). An entry found under
        a name no process is registered under (a forged XCLAIM) is taken back. Own entries
        still waiting for their turn in a replay are renewed too (peers would otherwise take
        them over with the evidence of a restarted name, which looks alive, ignored) and
        forgotten if they are no longer ours. ``via``: a broker of the caller's own (the
        triggerer renews from a thread with its own connections, which no other work can hold
        up)."""
        with self._lock:
            held = self._held.copy()
            queued = [
                p.id
                for p in (*self._replay_ready, *self._replay_suspects)
                if p.id not in self._held
            ]
        self._prune_now_and_then()
        if not held and not queued:
            return []
        survivors = [
            i for i in self.quarantine.due(self.stream, self.heartbeat_sec) if i in self._held
        ]
        # A chunk at a time, keeping only what is not ours any more: the ids' strings and
        # their statuses for every held entry at once were a transient ~90 bytes per entry
        # held, a hundred thousand of them a triggerer's (broker rule 41).
        status: dict[str, LeaseStatus] = {}
        suspect = self.quarantine.running(self.stream)
        for n, ids in enumerate(itertools.chain(held.chunks(RENEW_CHUNK), [queued])):
            if not ids:
                continue
            part = (via or self.broker).renew(
                self.stream,
                self.group,
                self.name,
                ids,
                survivors=survivors if n == 0 else (),
                suspect=suspect,
                lease_ms=self.lease.takeover_after_ms,
            )
            status.update((i, s) for i, s in part.items() if s is not LeaseStatus.OWNED)
        waiting = {i: status.pop(i, LeaseStatus.OWNED) for i in queued}
        if gone := {i for i, state in waiting.items() if state is not LeaseStatus.OWNED}:
            with self._lock:
                self._replay_ready = [p for p in self._replay_ready if p.id not in gone]
                self._replay_suspects = [p for p in self._replay_suspects if p.id not in gone]
        taken = [i for i, s in status.items() if s is LeaseStatus.TAKEN]
        if taken and self.owners is not None:
            try:
                back = self._take_back(taken[:BATCH])
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
        lost = [Lost(self.stream, i, s) for i, s in status.items() if s is not LeaseStatus.OWNED]
        self._drop([item.entry_id for item in lost])
        self.quarantine.forget(
            self.stream,
            {i for i in survivors if status.get(i, LeaseStatus.OWNED) is LeaseStatus.OWNED},
        )
        metrics.LEASE_RENEWALS.labels(self.stream).inc(len(held) - len(lost))
        return lost

    def _take_back(self, taken: Sequence[str]) -> list[str]:
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
            [(p.id, p.consumer) for p in forged],
        )
        if back:
            first = forged[0]
            log.warning(
                "%s: %d held entr(ies) of %s were claimed by a name that is not a registered"
                " consumer, e.g. %s by %r: taken back",
                self.name,
                len(back),
                self.stream,
                first.id,
                first.consumer,
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
            if not OUTAGE.redis_failed(exc, f"removing stopped consumers of {self.stream}"):
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
    outage: Outage = OUTAGE,
    backoff_cap: float = 5.0,
) -> bool:
    """Run a service's ``step`` until ``stop`` is set (or, with ``once``, until it has succeeded
    once; returns whether it did). A transient error (Redis or Postgres unreachable, a deadlock)
    is reported to the process's ``outage`` (which says so once a minute, not per attempt),
    backs off, calls ``recover`` (e.g. recreate a lost group) and goes on; any other error is
    logged with its traceback and backed off too: one bad loop must not stop the service.
    ``backoff_cap``: the longest wait between tries (a service's: half its heartbeat, so that
    a step's lease renewal, which needs Redis only, still comes before peers take its entries
    over while PostgreSQL is away)."""
    backoff = Backoff(cap=backoff_cap)
    while not stop.is_set():
        try:
            step()
        except Exception as exc:
            if is_transient(exc):
                outage.failed(exc)
            else:
                log.exception("unexpected error in the service loop; retrying")
            stop.wait(backoff.next())
            try:
                recover()
            except Exception as again:
                if not is_transient(again):
                    log.exception("recovering failed")
            continue
        outage.reached()
        backoff.reset()
        if once:
            return True
    return False
