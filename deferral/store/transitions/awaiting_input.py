"""Awaiting input (human in the loop): a task that asks a person waits in a state of its own.

| from           | event                          | to             | who                       |
| running        | HITLOperator asks (execute)    | awaiting_input | worker                    |
| awaiting_input | a person responds              | scheduled      | web UI / API / CLI        |
| awaiting_input | response timeout passed        | scheduled      | scheduler (SKIP LOCKED)   |
| awaiting_input | task cleared / marked          | none / ...     | CLI / web UI              |

A task awaiting input holds no worker slot, no pool slot and no trigger; it resumes at
``execute_complete`` with the response as its event (``deferral.store.hitl``)."""

from __future__ import annotations

from sqlalchemy.orm import Session

from deferral.states import TaskState
from deferral.store.transitions.attempts import Attempt
from deferral.store.transitions.core import TI, _move


def await_input(session: Session, attempt: Attempt) -> bool:
    """running -> awaiting_input (fenced on the attempt); the request is stored beside it."""
    return bool(
        _move(
            session,
            [attempt.task_instance_id],
            TaskState.RUNNING,
            TaskState.AWAITING_INPUT,
            "awaiting input",
            fence=attempt.fence(),
            trigger_id=None,
            next_method=None,
            next_kwargs=None,
            next_event=None,
            trigger_timeout=None,
        )
    )


def resume_awaiting_input(
    session: Session,
    ti_id: int,
    try_number: int,
    *,
    next_method: str,
    next_kwargs_token: str,
    next_event_token: str,
    reason: str,
) -> bool:
    """awaiting_input -> scheduled at ``next_method`` with the response as its event."""
    return bool(
        _move(
            session,
            [ti_id],
            TaskState.AWAITING_INPUT,
            TaskState.SCHEDULED,
            reason,
            fence=[TI.try_number == try_number],
            next_method=next_method,
            next_kwargs=next_kwargs_token,
            next_event=next_event_token,
        )
    )
