"""Pool slot accounting: how many slots each pool has free right now.

Running and queued task instances take ``pool_slots`` of their pool; deferred ones only when the
pool's ``include_deferred`` is set (a deferred task holds no worker slot, so by default it holds
no pool slot either).
"""

from __future__ import annotations

from collections.abc import Iterable

from sqlalchemy import and_, func, or_, select
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
    occupying = or_(
        TaskInstance.state.in_([TaskState.QUEUED, TaskState.RUNNING]),
        and_(TaskInstance.state == TaskState.DEFERRED, Pool.include_deferred),
    )
    used: dict[str, int] = dict(
        session.execute(
            select(TaskInstance.pool, func.sum(TaskInstance.pool_slots))
            .join(Pool, Pool.name == TaskInstance.pool)
            .where(TaskInstance.pool.in_([p.name for p in pools]), occupying)
            .group_by(TaskInstance.pool)
        ).all()
    )
    return {p.name: p.slots - int(used.get(p.name, 0)) for p in pools}
