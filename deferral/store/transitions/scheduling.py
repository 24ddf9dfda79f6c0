"""The scheduler's moves of task instances that are not running: scheduled when
their dependencies are met, woken when a retry or reschedule is due, skipped or never run,
dispatched to a queue."""

from __future__ import annotations

import datetime as dt
from collections.abc import Collection, Iterable, Mapping
from typing import Any

from sqlalchemy import Row, bindparam, func, select, text, update
from sqlalchemy.orm import Session

from deferral.states import TaskState
from deferral.store.transitions.core import _TI_TABLE, TI, _expire_loaded, _move

_NEW_TRY: dict[str, Any] = {
    "try_number": TI.try_number + 1,
    "first_started_at": None,
    "start_date": None,
    "end_date": None,
    "due_at": None,
}


def schedule(session: Session, ids: Iterable[int], reason: str = "dependencies met") -> list[int]:
    """none -> scheduled: a new try."""
    return _move(session, ids, TaskState.NONE, TaskState.SCHEDULED, reason, **_NEW_TRY)


def wake_due(
    session: Session, limit: int = 10_000, among: Collection[int] | None = None
) -> list[int]:
    """up_for_retry -> scheduled (a new try) and up_for_reschedule -> scheduled (same try, the
    sensor pokes again) for every task (``among`` these ids, if given) whose ``due_at`` has
    come: one indexed query, and the moves when something is due."""
    query = (
        select(TI.id, TI.state)
        # Spelled as the partial index ix_task_instance_due is, so the planner always uses it.
        .where(text("state IN ('up_for_retry', 'up_for_reschedule')"), TI.due_at <= func.now())
        .order_by(TI.due_at)
        .limit(limit)
    )
    if among is not None:
        query = query.where(TI.id.in_(list(among)))
    due = session.execute(query).all()
    retried = _move(
        session,
        [ti_id for ti_id, state in due if state == TaskState.UP_FOR_RETRY],
        TaskState.UP_FOR_RETRY,
        TaskState.SCHEDULED,
        "retry delay passed",
        **_NEW_TRY,
    )
    poked = _move(
        session,
        [ti_id for ti_id, state in due if state == TaskState.UP_FOR_RESCHEDULE],
        TaskState.UP_FOR_RESCHEDULE,
        TaskState.SCHEDULED,
        "reschedule due",
        start_date=None,
        end_date=None,
        due_at=None,
    )
    return retried + poked


def set_retry_due(session: Session, due: Mapping[int, dt.datetime]) -> None:
    """Give up_for_retry tasks failed without their retry delay at hand (their worker stopped)
    the time of their next try, computed from the DAG."""
    if due:
        session.execute(
            update(_TI_TABLE)
            .where(
                _TI_TABLE.c.id == bindparam("b_id"),
                _TI_TABLE.c.state == TaskState.UP_FOR_RETRY,
                _TI_TABLE.c.due_at.is_(None),
            )
            .values(due_at=bindparam("b_due")),
            [{"b_id": ti_id, "b_due": at} for ti_id, at in due.items()],
        )


def never_run(session: Session, ids: Iterable[int], to_state: TaskState, reason: str) -> list[int]:
    """none -> skipped / upstream_failed, decided by a trigger rule; or skipped / failed /
    removed, decided by a mapped task's expansion (nothing to map over, an input that cannot
    be mapped, a map index its input no longer has)."""
    return _move(session, ids, TaskState.NONE, to_state, reason, end_date=func.now())


_DISPATCH_SQL = text(
    """
    WITH moved AS (
        UPDATE task_instance SET state = 'queued', queued_at = now(), updated_at = now()
        WHERE id = ANY(CAST(:ids AS bigint[])) AND state = 'scheduled'
        RETURNING id, try_number, queue, dag_id, run_id, task_id, map_index, priority_weight
    ), recorded AS (
        INSERT INTO task_state_change (task_instance_id, from_state, to_state, reason)
        SELECT id, 'scheduled', 'queued', 'dispatched' FROM moved ORDER BY id
    )
    SELECT id, try_number, queue, dag_id, run_id, task_id, map_index FROM moved
    ORDER BY priority_weight DESC, id
    """
)


def dispatch(session: Session, ids: Iterable[int]) -> list[Row[Any]]:
    """scheduled -> queued, in one statement; returns what a queue message needs for each moved
    row, highest priority first (the queue stream is read in this order)."""
    ids = list(ids)
    if not ids:
        return []
    rows = list(session.execute(_DISPATCH_SQL, {"ids": ids}))
    _expire_loaded(session, [row.id for row in rows])
    return rows


def skip_tasks(session: Session, skipped_by: int, task_ids: Collection[str]) -> list[int]:
    """none / scheduled -> skipped for the task instances (every map index) of ``task_ids`` in
    the run of task instance ``skipped_by``: the tasks a branch or short circuit chose not to
    run. Call it in the transaction where that task's success moved; the reason names it."""
    if not task_ids:
        return []
    chooser = session.get(TI, skipped_by)
    if chooser is None:
        return []
    ids = session.scalars(
        select(TI.id).where(
            TI.dag_id == chooser.dag_id, TI.run_id == chooser.run_id, TI.task_id.in_(task_ids)
        )
    ).all()
    reason = f"skipped by {chooser.task_id}"
    return [
        ti_id
        for from_state in (TaskState.NONE, TaskState.SCHEDULED)
        for ti_id in _move(session, ids, from_state, TaskState.SKIPPED, reason, end_date=func.now())
    ]
