"""What a user asks of a task instance: clear it (a new try) or mark it."""

from __future__ import annotations

from typing import Any

from sqlalchemy import delete, func
from sqlalchemy.orm import Session

from deferral.states import TaskState
from deferral.store.tables import TaskInstance, Trigger
from deferral.store.transitions.attempts import _END_OF_ATTEMPT
from deferral.store.transitions.core import _move

# A running attempt cannot be cleared or marked from here: its worker would go on running it.
USER_SETTABLE_FROM = frozenset(set(TaskState) - {TaskState.RUNNING, TaskState.QUEUED})


def _by_user(
    session: Session, ti: TaskInstance, to_state: TaskState, reason: str, **values: Any
) -> bool:
    """Move one task instance on a user's word; a deferred one lets go of its trigger (the
    triggerer sees the task gone and cancels the trigger, calling its on_kill)."""
    if ti.state not in USER_SETTABLE_FROM:
        return False
    trigger_id = ti.trigger_id
    moved = _move(
        session,
        [ti.id],
        TaskState(ti.state),
        to_state,
        reason,
        trigger_id=None,
        due_at=None,
        **_END_OF_ATTEMPT,
        **values,
    )
    if moved and trigger_id is not None:
        # A shared trigger stays for its other waiters (drop_unwaited goes after the last).
        session.execute(
            delete(Trigger).where(Trigger.id == trigger_id, Trigger.share_key.is_(None))
        )
    return bool(moved)


def clear(session: Session, ti: TaskInstance, retries: int) -> bool:
    """any state but queued/running -> none, to run again as a new try with ``retries`` left."""
    return _by_user(
        session,
        ti,
        TaskState.NONE,
        "cleared by user",
        max_tries=ti.try_number + retries,
        start_date=None,
        end_date=None,
    )


def mark(session: Session, ti: TaskInstance, to_state: TaskState) -> bool:
    """any state but queued/running -> success / failed / skipped."""
    return _by_user(session, ti, to_state, f"marked {to_state} by user", end_date=func.now())
