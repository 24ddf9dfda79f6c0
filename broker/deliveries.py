"""Pure decisions of the consumer core about what it is given: whether an entry is within the size
limits, whether a pending entry is a suspect and how many of its deliveries count toward
``DEFERRAL_MAX_DELIVERIES``, which pending entries to take now, and when a process may run a
suspect. No I/O here: :mod:`broker.consumer` gathers the facts (XPENDING, the start evidence, the
consumers' rows in PostgreSQL) and acts on the answers.

Suspects (broker/DECISIONS.md, rule 31). A consumer writes an entry's *start evidence* before
anything of the entry runs, and the evidence is deleted once the entry has run a whole heartbeat
or ended. An entry whose holder died while its evidence stood is a suspect: it may have killed
its consumer. An entry delivered but never started (a timer waiting in a heap, an entry read by a
process that died before starting it) has no evidence and is no suspect. Suspects run one at a
time in the whole group (one claim per stream in Redis), each in a process that runs nothing
else unproven, and only a delivery in which an entry was that one running suspect counts
against it: the evidence holds that count.

The evidence, like any value in Redis, can be written by anyone with access, so it is believed
only when PostgreSQL agrees that the consumer holding the entry was a registered process that
died holding it.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from deferral.store.liveness import stale_after_sec

# No message of ours has more than 8 fields; an event's payload or a trigger's sealed kwargs may
# be large, but not megabytes. Anything beyond is dead-lettered unread.
MAX_ENTRY_FIELDS = 16
MAX_ENTRY_BYTES = 4 * 1024 * 1024


def over_limits(fields: Mapping[bytes, bytes]) -> str | None:
    """Why an entry is too large to be handled (one line naming the limit), or None."""
    if len(fields) > MAX_ENTRY_FIELDS:
        return f"entry of {len(fields)} fields is over the limit of {MAX_ENTRY_FIELDS} fields"
    size = 0
    for key, value in fields.items():
        size += len(key) + len(value)
    if size > MAX_ENTRY_BYTES:
        return f"entry of {size} bytes is over the limit of {MAX_ENTRY_BYTES} bytes"
    return None


@dataclass(frozen=True)
class OwnerRecord:
    """What PostgreSQL says of a consumer: its process's row (worker, triggerer, scheduler)."""

    running: bool  # state running (not stopped)
    heartbeat_age_sec: float  # since its latest heartbeat, by the database's clock


class OwnerRegistry(Protocol):
    """The rows of the processes that consume a stream, by consumer name (absent: unregistered)."""

    def owners(self, names: Collection[str]) -> Mapping[str, OwnerRecord]: ...


@dataclass(frozen=True)
class Judged:
    """How one pending entry is taken."""

    counted: int  # its deliveries counted so far (each as the one suspect running, and fatal)
    suspect: bool = False  # started, and its holder died before it ran a whole heartbeat
    distrusted: str | None = None  # why the start evidence was set aside (to be logged)
    wait: bool = False  # leave it for now: its real holder may still take it back


def judge_takeover(
    started: int | None,
    idle_ms: int,
    owner_name: str,
    owner: OwnerRecord | None,
    *,
    heartbeat_sec: float,
    unregistered_for_sec: float,
) -> Judged:
    """An idle entry a peer stopped renewing, with its start evidence (``started``: the
    deliveries counted against it, None without evidence). The evidence is believed only if its
    holder is a registered process that may have died holding it: it stopped heartbeating, or
    its last heartbeat is no later than the entry's last renewal (a live process renews its
    entries in the same beat). An entry held by a name PostgreSQL does not know is no one's
    delivery: it is left for two heartbeats (a live holder that lost it to a forged XCLAIM takes
    it back at its next renewal), then taken with its evidence ignored."""
    if owner is None:
        if unregistered_for_sec < 2 * heartbeat_sec:
            return Judged(0, wait=True)
        reason = f"held by {owner_name!r}, which is not a registered consumer"
        return Judged(0, distrusted=reason if started is not None else None)
    if not owner.running:
        # Stopped gracefully and handed its entries off: none of them killed it.
        return Judged(0)
    idle_sec = idle_ms / 1000
    if owner.heartbeat_age_sec + heartbeat_sec < idle_sec:
        reason = (
            f"{owner_name!r} heartbeated {owner.heartbeat_age_sec:.1f} s ago, after the entry"
            f" went idle {idle_sec:.1f} s ago: it did not die holding it"
        )
        return Judged(0, distrusted=reason if started is not None else None)
    if started is None:
        return Judged(0)
    return Judged(started, suspect=True)


def judge_replay(started: int | None, previous: OwnerRecord | None) -> Judged:
    """An entry left pending under this consumer's own name by its previous process, with its
    start evidence. It is a suspect only if that process was registered and did not record a
    clean stop (then it died holding the entry) while the evidence stood."""
    if previous is None:
        reason = "no earlier process of this name is registered"
        return Judged(0, distrusted=reason if started is not None else None)
    if not previous.running or started is None:
        return Judged(0)
    return Judged(started, suspect=True)


@dataclass(frozen=True)
class Candidate:
    id: str
    judged: Judged


@dataclass(frozen=True)
class SortedOut:
    """Pending entries sorted out: ``free`` may be taken together now, ``suspects`` only one at
    a time in the whole group, in this order."""

    free: list[str]
    suspects: list[str]


def sort_out(candidates: Sequence[Candidate], max_deliveries: int) -> SortedOut:
    """``free``: every entry that is no suspect, and every suspect past the cap (it is
    dead-lettered without running), in the order given. ``suspects``: the others, least counted
    first (lowest id first), so a healthy entry that arrived beside a poison runs before the
    poison runs again."""
    free = [c.id for c in candidates if not c.judged.suspect or c.judged.counted >= max_deliveries]
    suspects = [c for c in candidates if c.judged.suspect and c.judged.counted < max_deliveries]
    suspects.sort(key=lambda c: (c.judged.counted, id_key(c.id)))
    return SortedOut(free, [c.id for c in suspects])


def may_run_suspect(running_suspect: bool, unproven: int) -> bool:
    """Whether a process may take a suspect: it runs none already, and everything it started has
    run a whole heartbeat (else a poison among those would be blamed on the suspect)."""
    return not running_suspect and unproven == 0


def due_for_proof(started_at: Mapping[str, float], now: float, heartbeat_sec: float) -> list[str]:
    """The entries (id -> when they started, monotonic) that have run a whole heartbeat: their
    start evidence is deleted (they did not kill their consumer)."""
    return [i for i, at in started_at.items() if now - at >= heartbeat_sec]


def id_key(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    try:
        return int(ms), int(seq or 0)
    except ValueError:
        return 0, 0


def prunable(
    consumers: Mapping[str, int],
    owners: Mapping[str, OwnerRecord],
    *,
    me: str,
    heartbeat_sec: float,
) -> list[str]:
    """Consumers of a group to delete (``consumers``: name -> pending count): those with nothing
    pending whose process is not alive (stopped, stale heartbeat, or never registered)."""
    stale = stale_after_sec(heartbeat_sec)
    found = []
    for name, pending in consumers.items():
        if name == me or pending > 0:
            continue
        owner = owners.get(name)
        if owner is None or not owner.running or owner.heartbeat_age_sec > stale:
            found.append(name)
    return found
