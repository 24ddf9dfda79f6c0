"""Start and end in the triggerer (Airflow 2.10's ``start_from_trigger`` and
``end_from_trigger``): scheduled -> deferred without a worker, and deferred -> success /
skipped / up_for_retry / failed on a task-end event, without a worker either."""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import delete, func, select
from sqlalchemy.orm import Session

from deferral.runtime import serialization
from deferral.states import END_KINDS, TaskState
from deferral.store import xcom
from deferral.store.tables import Trigger
from deferral.store.transitions.attempts import _END_OF_ATTEMPT, has_tries_left
from deferral.store.transitions.core import TI, _move

STARTED_IN_TRIGGERER = "started in the triggerer: deferred to trigger "
ENDED_BY_TRIGGER = "ended by trigger "  # "ended by trigger <id>: success"


@dataclass(frozen=True)
class TriggerStart:
    """A scheduled task that starts in the triggerer: its trigger (kwargs sealed) and the
    point it resumes at."""

    task_instance_id: int
    classpath: str
    kwargs_token: str
    next_method: str
    next_kwargs_token: str
    trigger_timeout: dt.datetime | None


def start_from_trigger(session: Session, starts: Sequence[TriggerStart]) -> dict[int, int]:
    """scheduled -> deferred for tasks whose first step is a trigger (no worker runs
    ``execute``); their try is the one scheduling started. Returns task instance id -> trigger
    id for those that moved (one still scheduled; another replica may have taken the rest)."""
    moved: dict[int, int] = {}
    for start in starts:
        trigger = Trigger(classpath=start.classpath, kwargs=start.kwargs_token)
        session.add(trigger)
        session.flush()
        trigger_id = trigger.id
        if _move(
            session,
            [start.task_instance_id],
            TaskState.SCHEDULED,
            TaskState.DEFERRED,
            f"{STARTED_IN_TRIGGERER}{trigger_id}",
            fence=(TI.next_method.is_(None),),
            trigger_id=trigger_id,
            next_method=start.next_method,
            next_kwargs=start.next_kwargs_token,
            next_event=None,
            trigger_timeout=start.trigger_timeout,
        ):
            moved[start.task_instance_id] = trigger_id
        else:
            session.execute(delete(Trigger).where(Trigger.id == trigger_id))
    return moved


_STATE_OF_KIND = {kind: state for state, kind in END_KINDS.items()}


def end_from_trigger(
    session: Session, ti_ids: Sequence[int], trigger_id: int, kind: str, xcoms: dict[str, Any]
) -> list[int]:
    """deferred -> success / skipped, or for a failure up_for_retry (tries left: the scheduler
    sets when) or failed, for the tasks (locked by the caller) waiting on ``trigger_id``; the
    event's ``xcoms`` (opened) are pushed for each. Returns the ids moved to failed or
    up_for_retry (whose failure callbacks are to run)."""
    state = _STATE_OF_KIND[kind]
    reason = f"{ENDED_BY_TRIGGER}{trigger_id}: {state}"
    ended = {**_END_OF_ATTEMPT, "trigger_id": None, "end_date": func.now(), "due_at": None}
    failed: list[int] = []
    if state == TaskState.FAILED:
        tries = session.execute(select(TI.id, TI.try_number, TI.max_tries).where(TI.id.in_(ti_ids)))
        retry = [r.id for r in tries if has_tries_left(r.try_number, r.max_tries)]
        failed += _move(session, retry, TaskState.DEFERRED, TaskState.UP_FOR_RETRY, reason, **ended)
        rest = [ti for ti in ti_ids if ti not in set(retry)]
        failed += _move(session, rest, TaskState.DEFERRED, TaskState.FAILED, reason, **ended)
        moved = failed
    else:
        moved = _move(session, ti_ids, TaskState.DEFERRED, state, reason, **ended)
    items = [(ti, key, serialization.to_jsonable(v)) for ti in moved for key, v in xcoms.items()]
    xcom.upsert_many(session, items)
    session.execute(delete(Trigger).where(Trigger.id == trigger_id))
    return failed
