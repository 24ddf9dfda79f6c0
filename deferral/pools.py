"""Pool slot accounting: how many slots each pool has free right now.

Running and queued task instances take ``pool_slots`` of their pool; deferred ones only when the
pool's ``include_deferred`` is set (a deferred task holds no worker slot, so by default it holds
no pool slot either).
"""

from __future__ import annotations

from collections.abc import Iterable

from sqlalchemy import text
from sqlalchemy.orm import Session

# One statement: the pools locked in name order (so scheduler replicas dispatching into one pool
# at once cannot overfill it), each with the slots its queued and running tasks take, and its
# deferred ones only where the pool counts them. The sums are per pool, each an index read of the
# tasks in those states: a condition over both made every deferred task be read on every
# dispatch, a cost that grew with idle runs.
_FREE_SLOTS_SQL = text(
    """
    WITH locked AS (
        SELECT name, slots, include_deferred FROM pool
        WHERE CAST(:names AS text[]) IS NULL OR name = ANY(CAST(:names AS text[]))
        ORDER BY name
        FOR UPDATE
    )
    SELECT name, slots
        - COALESCE((SELECT sum(pool_slots) FROM task_instance
                    WHERE pool = locked.name AND state IN ('queued', 'running')), 0)
        - CASE WHEN include_deferred
            THEN COALESCE((SELECT sum(pool_slots) FROM task_instance
                           WHERE pool = locked.name AND state = 'deferred'), 0)
            ELSE 0 END
        AS free
    FROM locked
    """
)


def free_slots(session: Session, names: Iterable[str] | None = None) -> dict[str, int]:
    """Free slots of the named pools that exist (of every pool if ``names`` is None), counted
    under a lock on their rows."""
    chosen = None if names is None else sorted(set(names))
    return {name: int(free) for name, free in session.execute(_FREE_SLOTS_SQL, {"names": chosen})}
