"""What every transition shares: the conditional move of task instances with its recorded
state change, and the one rule that marks their runs for the scheduler's evaluation."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from sqlalchemy import ColumnElement, Table, func, insert, literal, select, text, update
from sqlalchemy.orm import Session
from sqlalchemy.orm.util import identity_key

from deferral.states import FINISHED_STATES, DagRunState, TaskState
from deferral.store.tables import DagRun, TaskInstance, TaskStateChange

TI = TaskInstance


# Core tables: executemany UPDATEs keyed by bound parameters are not ORM bulk updates.
_TI_TABLE: Table = TaskInstance.__table__  # type: ignore[assignment]


# Reaching one of these states may let the run move on (downstream tasks become decidable, the run
# may finish, a retry needs its due time): the run is marked for evaluation in the same statement.
MARKS_RUN = frozenset({*FINISHED_STATES, TaskState.NONE, TaskState.UP_FOR_RETRY})


# The one rule that marks the running runs of the task instances a statement moved (a CTE named
# ``moved`` with dag_id and run_id) for the scheduler's evaluation, as the CTE ``marked``: text
# statements put it in their WITH list, :func:`_move` adds it as a textual CTE.
#
# Every such run row is written, even one already marked: a run being evaluated is row-locked by
# the scheduler, which clears its mark when done. Skipping an already-marked run would let that
# clear erase this change unseen (the scheduler read the tasks before this commit), and the run
# would wait for ever. Writing waits for the lock instead, then marks the run again. Runs are
# locked in id order so that two batches touching the same runs cannot deadlock; an earlier mark
# keeps its place in the scheduler's queue.
_MARK_RUNS_UPDATE = """
        UPDATE dag_run
        SET evaluate_after = LEAST(COALESCE(evaluate_after, now()), now()), updated_at = now()
        WHERE state = 'running' AND id IN (
            SELECT run.id FROM dag_run AS run
            JOIN moved ON run.dag_id = moved.dag_id AND run.run_id = moved.run_id
            WHERE run.state = 'running'
            ORDER BY run.id
            FOR UPDATE OF run
        )
"""
MARK_RUNS_OF_MOVED = f"marked AS ({_MARK_RUNS_UPDATE})"
_MARKED = text(_MARK_RUNS_UPDATE).columns().cte("marked")


def _move(
    session: Session,
    ids: Iterable[int],
    from_state: TaskState,
    to_state: TaskState,
    reason: str,
    *,
    fence: Sequence[ColumnElement[bool]] = (),
    **values: Any,
) -> list[int]:
    """Move the rows among ``ids`` that are in ``from_state`` (and match ``fence``); record the
    change and mark their runs when ``to_state`` may let them move on; return the ids moved.
    One statement, whatever the number of rows."""
    ids = list(ids)
    if not ids:
        return []
    moved = (
        update(TI)
        .where(TI.id.in_(ids), TI.state == from_state, *fence)
        .values(state=to_state, updated_at=func.now(), **values)
        .returning(TI.id, TI.dag_id, TI.run_id)
        .cte("moved")
    )
    recorded = (
        insert(TaskStateChange)
        .from_select(
            ["task_instance_id", "from_state", "to_state", "reason"],
            select(moved.c.id, literal(from_state), literal(to_state), literal(reason)),
        )
        .cte("recorded")
    )
    statement = select(moved.c.id).add_cte(recorded)
    if to_state in MARKS_RUN:
        statement = statement.add_cte(_MARKED)
    moved_ids = list(session.scalars(statement))
    _expire_loaded(session, moved_ids)
    return moved_ids


def _expire_loaded(session: Session, ids: Iterable[int]) -> None:
    """Core statements bypass the ORM: rows of these ids already loaded in the session are
    reloaded on their next access."""
    if not session.identity_map:  # the plain-SQL paths load no objects: nothing to look up
        return
    for ti_id in ids:
        loaded = session.identity_map.get(identity_key(TI, ti_id))
        if loaded is not None:
            session.expire(loaded)


def mark_runs(session: Session, run_ids: Iterable[int]) -> None:
    """Ask the scheduler to evaluate these runs (a DAG changed, a task joined)."""
    ids = list(run_ids)
    if ids:
        session.execute(
            update(DagRun)
            .where(DagRun.id.in_(ids), DagRun.state.in_([DagRunState.QUEUED, DagRunState.RUNNING]))
            .values(evaluate_after=func.now())
        )
