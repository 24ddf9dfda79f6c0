"""Every change of a task instance's (and DAG run's) state, as conditional SQL.

Each transition is an ``UPDATE ... WHERE state = <from>`` so that a transition applied twice, or
by two replicas at once, changes the row at most once; the ids it really moved are returned and
recorded in ``task_state_change``. Callers own the transaction: a transition and whatever must
commit with it (an outbox row, a trigger row) go in one ``Session.begin()`` block.

The decisions of *which* rows to move (trigger rules, retry due, run finished) are pure functions
elsewhere; this module only applies them.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Row, Table, bindparam, delete, func, insert, select, text, update
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.orm import Session

from deferral import xcom
from deferral.crypto import Cipher
from deferral.models import (
    DagRun,
    ResumeEvent,
    TaskInstance,
    TaskReschedule,
    TaskStateChange,
    Trigger,
)
from deferral.states import FAIL_METHOD, DagRunState, TaskState

TI = TaskInstance

# Reasons recorded when a task leaves the deferred state; the triggerer reads them to tell why
# the trigger it runs is no longer wanted.
TIMED_OUT = "trigger timeout passed"
RESUMED_BY_TRIGGER = "trigger "  # "trigger <id> fired" / "trigger <id> failed"


def _record(
    session: Session, ids: Sequence[int], from_state: str, to_state: str, reason: str
) -> None:
    if ids:
        session.execute(
            insert(TaskStateChange),
            [
                {
                    "task_instance_id": i,
                    "from_state": from_state,
                    "to_state": to_state,
                    "reason": reason,
                }
                for i in ids
            ],
        )


def _move(
    session: Session,
    ids: Iterable[int],
    from_state: TaskState,
    to_state: TaskState,
    reason: str,
    **values: Any,
) -> list[int]:
    """Move the rows among ``ids`` that are in ``from_state``; return the ids moved."""
    ids = list(ids)
    if not ids:
        return []
    statement = (
        update(TI)
        .where(TI.id.in_(ids), TI.state == from_state)
        .values(state=to_state, updated_at=func.now(), **values)
        .returning(TI.id)
    )
    moved = list(session.scalars(statement))
    _record(session, moved, from_state, to_state, reason)
    return moved


# -- DAG runs ------------------------------------------------------------------------------------


def create_dag_run(
    session: Session, dag_id: str, run_id: str, logical_date: dt.datetime, conf: Mapping[str, Any]
) -> int:
    run = DagRun(
        dag_id=dag_id, run_id=run_id, logical_date=logical_date, state=DagRunState.QUEUED, conf=conf
    )
    session.add(run)
    session.flush()
    return run.id


@dataclass(frozen=True)
class NewTaskInstance:
    task_id: str
    max_tries: int
    pool: str
    pool_slots: int
    queue: str
    priority_weight: int


def start_dag_run(session: Session, run: DagRun, tasks: Sequence[NewTaskInstance]) -> None:
    """queued -> running, creating the run's task instances (state none)."""
    add_task_instances(session, run, tasks)
    run.state = DagRunState.RUNNING
    run.start_date = func.now()


def add_task_instances(session: Session, run: DagRun, tasks: Sequence[NewTaskInstance]) -> None:
    """Create task instances (state none) for tasks of the run that have none yet."""
    if tasks:
        session.execute(
            pg_insert(TI)
            .values(
                [
                    {
                        "dag_id": run.dag_id,
                        "run_id": run.run_id,
                        "task_id": t.task_id,
                        "max_tries": t.max_tries,
                        "pool": t.pool,
                        "pool_slots": t.pool_slots,
                        "queue": t.queue,
                        "priority_weight": t.priority_weight,
                    }
                    for t in tasks
                ]
            )
            .on_conflict_do_nothing()
        )


def finish_dag_run(session: Session, run: DagRun, state: DagRunState) -> None:
    run.state = state
    run.end_date = func.now()


# -- scheduler: none / up_for_retry -> scheduled -> queued ----------------------------------------


def schedule(session: Session, ids: Iterable[int], reason: str = "dependencies met") -> list[int]:
    """none -> scheduled: a new try."""
    return _move(
        session,
        ids,
        TaskState.NONE,
        TaskState.SCHEDULED,
        reason,
        try_number=TI.try_number + 1,
        first_started_at=None,
        start_date=None,
        end_date=None,
    )


def retry(session: Session, ids: Iterable[int]) -> list[int]:
    """up_for_retry -> scheduled once retry_delay has passed: a new try."""
    return _move(
        session,
        ids,
        TaskState.UP_FOR_RETRY,
        TaskState.SCHEDULED,
        "retry delay passed",
        try_number=TI.try_number + 1,
        first_started_at=None,
        start_date=None,
        end_date=None,
    )


def poke_again(session: Session, ids: Iterable[int]) -> list[int]:
    """up_for_reschedule -> scheduled once its reschedule date has come (same try)."""
    return _move(
        session,
        ids,
        TaskState.UP_FOR_RESCHEDULE,
        TaskState.SCHEDULED,
        "reschedule due",
        start_date=None,
        end_date=None,
    )


def never_run(session: Session, ids: Iterable[int], to_state: TaskState, reason: str) -> list[int]:
    """none -> skipped / upstream_failed, decided by a trigger rule."""
    return _move(session, ids, TaskState.NONE, to_state, reason, end_date=func.now())


def dispatch(session: Session, ids: Iterable[int]) -> list[Row[Any]]:
    """scheduled -> queued; returns what a queue message needs for each moved row."""
    moved = _move(
        session, ids, TaskState.SCHEDULED, TaskState.QUEUED, "dispatched", queued_at=func.now()
    )
    if not moved:
        return []
    columns = (TI.id, TI.try_number, TI.queue, TI.dag_id, TI.run_id, TI.task_id, TI.map_index)
    # Highest priority first: the queue stream is read in this order.
    order = (TI.priority_weight.desc(), TI.id)
    return list(session.execute(select(*columns).where(TI.id.in_(moved)).order_by(*order)))


# -- worker: queued -> running -> success / failed / up_for_retry / skipped / deferred ------------


def start(
    session: Session, ti_id: int, try_number: int, hostname: str, worker: str
) -> TaskInstance | None:
    """queued -> running, only for the try the queue message names: a duplicate or stale message
    moves nothing and returns None, so no attempt ever runs twice."""
    statement = (
        update(TI)
        .where(TI.id == ti_id, TI.state == TaskState.QUEUED, TI.try_number == try_number)
        .values(
            state=TaskState.RUNNING,
            hostname=hostname,
            worker=worker,
            start_date=func.coalesce(TI.start_date, func.now()),
            first_started_at=func.coalesce(TI.first_started_at, func.now()),
            updated_at=func.now(),
        )
        .returning(TI)
    )
    ti = session.scalars(statement).one_or_none()
    if ti is None:
        return None
    reason = "resumed" if ti.next_method else "picked up"
    _record(session, [ti.id], TaskState.QUEUED, TaskState.RUNNING, reason)
    if ti.next_method is None:
        # A new try starts with no XCom left over from an earlier try.
        session.execute(text("DELETE FROM xcom WHERE task_instance_id = :id"), {"id": ti.id})
    return ti


_END_OF_ATTEMPT: dict[str, Any] = {
    "next_method": None,
    "next_kwargs": None,
    "trigger_timeout": None,
}


def succeed(session: Session, ti_id: int, return_value: Any) -> bool:
    """running -> success; ``return_value`` (to_jsonable form) becomes XCom return_value."""
    moved = _move(
        session,
        [ti_id],
        TaskState.RUNNING,
        TaskState.SUCCESS,
        "returned",
        end_date=func.now(),
        **_END_OF_ATTEMPT,
    )
    if moved and return_value is not None:
        xcom.upsert(session, ti_id, "return_value", return_value)
    return bool(moved)


def skip(session: Session, ti_id: int, reason: str) -> bool:
    return bool(
        _move(
            session,
            [ti_id],
            TaskState.RUNNING,
            TaskState.SKIPPED,
            reason,
            end_date=func.now(),
            **_END_OF_ATTEMPT,
        )
    )


def fail(
    session: Session,
    ti_id: int,
    error: str,
    *,
    allow_retry: bool,
    try_number: int | None = None,
) -> TaskState | None:
    """running -> up_for_retry (tries left and allowed) or failed; returns the new state, or
    None if the task is not running (at ``try_number``, when given)."""
    ti = session.get(TI, ti_id, with_for_update=True)
    if ti is None or ti.state != TaskState.RUNNING:
        return None
    if try_number is not None and ti.try_number != try_number:
        return None
    to_state = (
        TaskState.UP_FOR_RETRY
        if allow_retry and ti.try_number <= ti.max_tries
        else TaskState.FAILED
    )
    _move(
        session, [ti_id], TaskState.RUNNING, to_state, error, end_date=func.now(), **_END_OF_ATTEMPT
    )
    return to_state


def reschedule(session: Session, ti_id: int, reschedule_date: dt.datetime) -> bool:
    """running -> up_for_reschedule until ``reschedule_date`` (same try; the slot is freed)."""
    ti = session.get(TI, ti_id)
    moved = _move(
        session,
        [ti_id],
        TaskState.RUNNING,
        TaskState.UP_FOR_RESCHEDULE,
        f"poke again at {reschedule_date.isoformat()}",
        end_date=func.now(),
    )
    if moved and ti is not None:
        session.add(
            TaskReschedule(
                task_instance_id=ti_id,
                try_number=ti.try_number,
                start_date=ti.start_date or func.now(),
                end_date=func.now(),
                reschedule_date=reschedule_date,
            )
        )
    return bool(moved)


def create_trigger(session: Session, classpath: str, kwargs_token: str, fingerprint: str) -> int:
    trigger = Trigger(classpath=classpath, kwargs=kwargs_token, fingerprint=fingerprint)
    session.add(trigger)
    session.flush()
    return trigger.id


def defer(
    session: Session,
    ti_id: int,
    *,
    trigger_id: int,
    next_method: str,
    next_kwargs_token: str,
    trigger_timeout: dt.datetime | None,
) -> bool:
    """running -> deferred, waiting on ``trigger_id``."""
    return bool(
        _move(
            session,
            [ti_id],
            TaskState.RUNNING,
            TaskState.DEFERRED,
            f"deferred to trigger {trigger_id}",
            trigger_id=trigger_id,
            next_method=next_method,
            next_kwargs=next_kwargs_token,
            trigger_timeout=trigger_timeout,
        )
    )


# -- scheduler: deferred -> scheduled ------------------------------------------------------------


@dataclass(frozen=True)
class FiredEvent:
    dedup_key: str
    trigger_id: int
    failed: bool  # the trigger failed (raised, ended without an event, could not be built)
    payload: Any  # the event payload, or for a failure {"error": ..., "traceback": ...}


def resume(session: Session, event: FiredEvent, cipher: Cipher) -> str:
    """:func:`resume_many` for one event."""
    return resume_many(session, [event], cipher)[0]


def _resumed_at(event: FiredEvent, ti: TaskInstance, cipher: Cipher) -> tuple[str | None, str, str]:
    """(next_method, sealed next_kwargs, reason) of a task resumed by ``event``."""
    if event.failed:
        kwargs = {"error": "trigger_failure", **event.payload}
        return (
            FAIL_METHOD,
            cipher.seal(kwargs, "next_kwargs"),
            (f"{RESUMED_BY_TRIGGER}{event.trigger_id} failed"),
        )
    kwargs = cipher.open(ti.next_kwargs) if ti.next_kwargs else {}
    sealed = cipher.seal({**kwargs, "event": event.payload}, "next_kwargs")
    return ti.next_method, sealed, f"{RESUMED_BY_TRIGGER}{event.trigger_id} fired"


# Core tables: executemany UPDATEs keyed by bound parameters are not ORM bulk updates.
_TI_TABLE: Table = TaskInstance.__table__  # type: ignore[assignment]
_RESUME_TABLE: Table = ResumeEvent.__table__  # type: ignore[assignment]


def resume_many(session: Session, events: Sequence[FiredEvent], cipher: Cipher) -> list[str]:
    """deferred -> scheduled for the tasks waiting on the events' triggers, at most once per
    dedup key, in a handful of statements whatever the batch size. Returns each event's outcome
    as recorded in resume_event: applied, duplicate (key seen before) or stale (its task was
    cleared, timed out, or resumed by an earlier event)."""
    if not events:
        return []
    outcomes = ["duplicate"] * len(events)
    first: dict[str, int] = {}
    for index, event in enumerate(events):
        first.setdefault(event.dedup_key, index)
    claimed = set(
        session.scalars(
            pg_insert(ResumeEvent)
            .values(
                [
                    {
                        "dedup_key": events[i].dedup_key,
                        "trigger_id": events[i].trigger_id,
                        "outcome": "stale",
                    }
                    for i in first.values()
                ]
            )
            .on_conflict_do_nothing()
            .returning(ResumeEvent.dedup_key)
        )
    )
    for key in claimed:
        outcomes[first[key]] = "stale"
    waiting = {
        ti.trigger_id: ti
        for ti in session.scalars(
            select(TI)
            .where(
                TI.trigger_id.in_({events[first[key]].trigger_id for key in claimed}),
                TI.state == TaskState.DEFERRED,
            )
            .order_by(TI.id)
            .with_for_update()
        )
    }
    moves, changes, applied = [], [], []
    for key in sorted(claimed, key=first.__getitem__):
        event = events[first[key]]
        ti = waiting.pop(event.trigger_id, None)  # a second event for it finds it resumed
        if ti is None:
            continue
        next_method, sealed, reason = _resumed_at(event, ti, cipher)
        moves.append({"b_id": ti.id, "b_method": next_method, "b_kwargs": sealed})
        changes.append(
            {
                "task_instance_id": ti.id,
                "from_state": TaskState.DEFERRED,
                "to_state": TaskState.SCHEDULED,
                "reason": reason,
            }
        )
        applied.append({"b_key": key, "b_ti": ti.id, "b_trigger": event.trigger_id})
        outcomes[first[key]] = "applied"
    if moves:
        # The rows are locked and deferred (selected FOR UPDATE above): update them by id.
        session.execute(
            update(_TI_TABLE)
            .where(_TI_TABLE.c.id == bindparam("b_id"))
            .values(
                state=TaskState.SCHEDULED,
                trigger_id=None,
                trigger_timeout=None,
                next_method=bindparam("b_method"),
                next_kwargs=bindparam("b_kwargs"),
                updated_at=func.now(),
            ),
            moves,
        )
        session.execute(insert(TaskStateChange), changes)
        session.execute(delete(Trigger).where(Trigger.id.in_([a["b_trigger"] for a in applied])))
        session.execute(
            update(_RESUME_TABLE)
            .where(_RESUME_TABLE.c.dedup_key == bindparam("b_key"))
            .values(outcome="applied", task_instance_id=bindparam("b_ti")),
            [{"b_key": a["b_key"], "b_ti": a["b_ti"]} for a in applied],
        )
    return outcomes


_EXPIRE_SQL = text(
    """
    WITH expired AS (
        UPDATE task_instance AS ti
        SET state = 'scheduled', trigger_id = NULL, trigger_timeout = NULL,
            next_method = :fail_method, next_kwargs = :fail_kwargs, updated_at = now()
        FROM (
            SELECT id, trigger_id FROM task_instance
            WHERE state = 'deferred' AND trigger_timeout < now()
            ORDER BY trigger_timeout
            LIMIT :limit
            FOR UPDATE SKIP LOCKED
        ) AS old
        WHERE ti.id = old.id
        RETURNING ti.id, old.trigger_id
    ), recorded AS (
        INSERT INTO task_state_change (task_instance_id, from_state, to_state, reason)
        SELECT id, 'deferred', 'scheduled', :reason FROM expired
    ), dropped AS (
        DELETE FROM trigger WHERE id IN (SELECT trigger_id FROM expired)
    )
    SELECT id FROM expired
    """
)


def expire_deferrals(session: Session, cipher: Cipher, limit: int = 10_000) -> list[int]:
    """deferred -> scheduled at ``__fail__`` for every task whose trigger_timeout passed, in one
    statement; the worker then raises TaskDeferralTimeout inside the task."""
    token = cipher.seal({"error": "timeout"}, "next_kwargs")
    params = {"fail_method": FAIL_METHOD, "fail_kwargs": token, "limit": limit, "reason": TIMED_OUT}
    return list(session.scalars(_EXPIRE_SQL, params))


# -- users: clear and mark (the CLI) ---------------------------------------------------------------

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
        **_END_OF_ATTEMPT,
        **values,
    )
    if moved and trigger_id is not None:
        session.execute(delete(Trigger).where(Trigger.id == trigger_id))
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


def reopen_dag_run(session: Session, run: DagRun) -> None:
    """A finished run whose tasks were cleared runs again."""
    if run.state in (DagRunState.SUCCESS, DagRunState.FAILED):
        run.state = DagRunState.RUNNING
        run.end_date = None
