"""Pool slot accounting: how many slots each pool has free right now.

Running and queued task instances take ``pool_slots`` of their pool; deferred ones only when the
pool's ``include_deferred`` is set (a deferred task holds no worker slot, so by default it holds
no pool slot either).
"""

from __future__ import annotations

from collections.abc import Iterable

from sqlalchemy import text
from sqlalchemy.orm import Session

# The pools locked in name order, so that scheduler replicas dispatching into one pool at once
# take turns and cannot overfill it.
_LOCK_SQL = text(
    """
    SELECT name FROM pool
    WHERE CAST(:names AS text[]) IS NULL OR name = ANY(CAST(:names AS text[]))
    ORDER BY name
    FOR UPDATE
    """
)

# Each locked pool with the slots its queued and running tasks take, and its deferred ones only
# where the pool counts them; read by a statement after the lock, whose snapshot then holds what
# the lock's last holder queued (a count read in the statement that waited for the lock misses
# it: two dispatchers both found the 2 slots of a 2-slot pool free). The sums are per pool, each
# an index read of the tasks in those states: a condition over both made every deferred task be
# read on every dispatch, a cost that grew with idle runs.
FREE_SLOTS_OF_NAMED = """
    SELECT name, slots
        - COALESCE((SELECT sum(pool_slots) FROM task_instance
                    WHERE pool = p.name AND state IN ('queued', 'running')), 0)
        - CASE WHEN include_deferred
            THEN COALESCE((SELECT sum(pool_slots) FROM task_instance
                           WHERE pool = p.name AND state = 'deferred'), 0)
            ELSE 0 END
        AS free
    FROM pool AS p
    WHERE CAST(:names AS text[]) IS NULL OR name = ANY(CAST(:names AS text[]))
    """
_FREE_SLOTS_SQL = text(FREE_SLOTS_OF_NAMED)

# The pools of the tasks in a CTE ``ready`` (with a column ``pool``), locked as _LOCK_SQL does,
# for a statement that reads those tasks to lock them too (the resume path's).
LOCK_POOLS_OF_READY = """
    SELECT name FROM pool WHERE name IN (SELECT pool FROM ready) ORDER BY name FOR UPDATE
    """


def free_slots(
    session: Session, names: Iterable[str] | None = None, *, locked: bool = False
) -> dict[str, int]:
    """Free slots of the named pools that exist (of every pool if ``names`` is None), counted
    under a lock on their rows: taken here, or (``locked``) by the caller's earlier statement."""
    chosen = None if names is None else sorted(set(names))
    if not locked:
        session.execute(_LOCK_SQL, {"names": chosen})
    return {name: int(free) for name, free in session.execute(_FREE_SLOTS_SQL, {"names": chosen})}
