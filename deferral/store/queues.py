"""Queues of triggerers and workers: the ``--queues a,b`` lists and who serves a queue.

A triggerer or worker records the queues it serves in its row (``triggerer.queues``,
``worker.queue``) as the comma-separated text of its ``--queues``; a triggerer's NULL means
every queue. Both the services and the read model (``doctor``, ``tasks explain``) go through
these functions, so the text is parsed in one place.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from sqlalchemy import select
from sqlalchemy.orm import Session

from deferral.dag import check_id
from deferral.store import liveness
from deferral.store.doctor import Check, Status
from deferral.store.tables import Triggerer

# The recorded text fits the rows' column (String(256)).
MAX_QUEUES_TEXT = 256


def parse_queues(text: str) -> tuple[str, ...]:
    """The queues of a ``--queues`` value (``a,b``: spaces around names ignored, duplicates
    dropped, order kept); ValueError naming the fault."""
    names = tuple(dict.fromkeys(part.strip() for part in text.split(",")))
    if not text.strip() or "" in names:
        raise ValueError(f"{text[:80]!r} is not a comma-separated list of queue names")
    for name in names:
        check_id("queue", name)
    joined = ",".join(names)
    if len(joined) > MAX_QUEUES_TEXT:
        raise ValueError(f"the queues take {len(joined)} characters; at most {MAX_QUEUES_TEXT}")
    return names


def recorded(queues: Iterable[str] | None) -> str | None:
    """What a row records of the queues served (None: every queue)."""
    return None if queues is None else ",".join(queues)


def serves(recorded_queues: str | None, queue: str) -> bool:
    """Whether a process whose row records ``recorded_queues`` serves ``queue``."""
    return recorded_queues is None or queue in recorded_queues.split(",")


def served_by_live_triggerers(session: Session, heartbeat_sec: float) -> list[str | None]:
    """What each live triggerer's row records of the queues it serves (None: every queue)."""
    alive = liveness.alive_clause(Triggerer, heartbeat_sec)
    return list(session.scalars(select(Triggerer.queues).where(alive)))


def unserved(queue: str, served: Sequence[str | None]) -> bool:
    """Whether no live triggerer (of those whose rows recorded ``served``) serves ``queue``."""
    return not any(serves(recorded_queues, queue) for recorded_queues in served)


# Waiting triggers named per queue at most, in doctor's line.
NAMED_PER_QUEUE = 5


@dataclass(frozen=True)
class Waiting:
    """The deferred tasks of one queue: how many, and a few of their triggers, named."""

    queue: str
    count: int
    named: Sequence[str]  # "trigger 12 (dag.run.task)"


def queues_served(stuck: Sequence[Waiting]) -> Check:
    """``doctor``: every deferred task's queue must be served by a live triggerer, else its
    trigger waits for ever. ``stuck``: the deferred tasks of the queues none serves."""
    name = "trigger queues served"
    if not stuck:
        return Check(Status.OK, name, "every deferred task's queue has a live triggerer")
    parts = []
    for w in stuck:
        more = w.count - len(w.named)
        listed = ", ".join(w.named) + (f" and {more} more" if more > 0 else "")
        parts.append(f"queue {w.queue!r}: {listed}")
    return Check(
        Status.FAIL,
        name,
        "no live triggerer serves "
        + "; ".join(parts)
        + ": start `triggerer consume --queues "
        + ",".join(w.queue for w in stuck)
        + "` (or one without --queues)",
    )
