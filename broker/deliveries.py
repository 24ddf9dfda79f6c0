"""Pure decisions of the consumer core about what it is given: whether an entry is within the size
limits, how many of an entry's deliveries count toward ``DEFERRAL_MAX_DELIVERIES``, and which
pending entries to take now. No I/O here: :mod:`broker.consumer` gathers the facts (XPENDING,
the consumers' rows in PostgreSQL) and acts on the answers.

Delivery counts. Redis keeps a count per pending entry, but anyone with write access to Redis can
set it (``XCLAIM … RETRYCOUNT 10``), so it is only believed when PostgreSQL agrees that the
consumer holding the entry was a registered process that died holding it. Renewal resets the
count of an entry held a whole heartbeat to 0, so a count is "deliveries since the entry last
survived a heartbeat": 0 means its last holder ran it safely, 1 or more that each holder died
within a heartbeat of taking it (a suspect).
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
    """How one pending entry's delivery count is taken."""

    counted: int  # deliveries before the next one that count toward the cap
    distrusted: str | None = None  # why the count Redis gives was set aside (to be logged)
    wait: bool = False  # leave it for now: its real holder may still take it back


def judge_takeover(
    redis_count: int,
    idle_ms: int,
    owner_name: str,
    owner: OwnerRecord | None,
    *,
    heartbeat_sec: float,
    unregistered_for_sec: float,
) -> Judged:
    """An idle entry a peer stopped renewing. Its count is believed only if its holder is a
    registered process that may have died holding it: it stopped heartbeating, or its last
    heartbeat is no later than the entry's last renewal (a live process renews its entries in
    the same beat). An entry held by a name PostgreSQL does not know is no one's delivery: it is
    left for two heartbeats (a live holder that lost it to a forged XCLAIM takes it back at its
    next renewal), then taken with its count ignored."""
    if owner is None:
        if unregistered_for_sec < 2 * heartbeat_sec:
            return Judged(0, wait=True)
        reason = f"held by {owner_name!r}, which is not a registered consumer"
        return Judged(0, reason if redis_count > 0 else None)
    if not owner.running:
        # Stopped gracefully and handed its entries off: none of them killed it.
        return Judged(0)
    idle_sec = idle_ms / 1000
    if owner.heartbeat_age_sec + heartbeat_sec < idle_sec:
        reason = (
            f"{owner_name!r} heartbeated {owner.heartbeat_age_sec:.1f} s ago, after the entry"
            f" went idle {idle_sec:.1f} s ago: it did not die holding it"
        )
        return Judged(0, reason if redis_count > 0 else None)
    return Judged(max(0, redis_count))


def judge_replay(redis_count: int, previous: OwnerRecord | None) -> Judged:
    """An entry left pending under this consumer's own name by its previous process. Its count
    is believed only if that process was registered and did not record a clean stop (then it
    died holding the entry)."""
    if previous is None:
        reason = "no earlier process of this name is registered"
        return Judged(0, reason if redis_count > 0 else None)
    if not previous.running:
        return Judged(0)
    return Judged(max(0, redis_count))


@dataclass(frozen=True)
class Candidate:
    id: str
    counted: int  # from judge_*


def choose(
    candidates: Sequence[Candidate], max_deliveries: int, *, suspect_allowed: bool
) -> list[str]:
    """The ids to take now, in the order given: every entry whose last holder survived it
    (counted 0) and every entry past the cap (it is dead-lettered without running), plus, when
    ``suspect_allowed``, the one suspect delivered least (lowest id first). Suspects are run one
    at a time, each after the last has survived a heartbeat, so only the entry that kills its
    consumer keeps gaining deliveries."""
    take = [c.id for c in candidates if c.counted == 0 or c.counted >= max_deliveries]
    if suspect_allowed:
        suspects = [c for c in candidates if 0 < c.counted < max_deliveries]
        if suspects:
            take.append(min(suspects, key=lambda c: (c.counted, _id_key(c.id))).id)
    return take


def _id_key(entry_id: str) -> tuple[int, int]:
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
