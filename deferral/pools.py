"""Pool slot accounting: how many slots each pool has free right now.

Running and queued task instances take ``pool_slots`` of their pool; deferred ones only when the
pool's ``include_deferred`` is set (a deferred task holds no worker slot, so by default it holds
no pool slot either).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from deferral.models import Pool, TaskInstance
from deferral.states import TaskState


def free_slots(session: Session, names: Iterable[str] | None = None) -> dict[str, int]:
    """Free slots of the named pools that exist (of every pool if ``names`` is None), counted
    under a lock on their rows, so that scheduler replicas dispatching into one pool at once
    cannot overfill it."""
    query = select(Pool).order_by(Pool.name).with_for_update()
    if names is not None:
        query = query.where(Pool.name.in_(sorted(set(names))))
    pools = session.scalars(query).all()
    if not pools:
        return {}
    # Deferred tasks are counted apart, and only for pools that count them: one condition over
    # both made every deferred task be read on every dispatch (a cost that grew with idle runs).
    used: Counter[str] = Counter()
    for states, names in (
        ([TaskState.QUEUED, TaskState.RUNNING], [p.name for p in pools]),
        ([TaskState.DEFERRED], [p.name for p in pools if p.include_deferred]),
    ):
        if names:
            used.update(
                {
                    pool: int(slots)
                    for pool, slots in session.execute(
                        select(TaskInstance.pool, func.sum(TaskInstance.pool_slots))
                        .where(TaskInstance.pool.in_(names), TaskInstance.state.in_(states))
                        .group_by(TaskInstance.pool)
                    )
                }
            )
    return {p.name: p.slots - used[p.name] for p in pools}
