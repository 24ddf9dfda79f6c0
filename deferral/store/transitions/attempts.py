"""A worker's attempt at a task: started, and ended as success, skip, failure (into
its retry or not) or reschedule, each fenced on the try number and the worker."""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import ColumnElement, func, select, text, tuple_
from sqlalchemy.orm import Session

from deferral.states import TaskState
from deferral.store import tasklogs
from deferral.store.tables import TaskReschedule
from deferral.store.transitions.asset_events import OUTLET_EVENTS_OF_MOVED
from deferral.store.transitions.core import MARK_RUNS_OF_MOVED, TI, _expire_loaded, _move


@dataclass(frozen=True)
class Attempt:
    """One try of a task instance as run by one worker. Every outcome a worker writes is fenced
    on all three: a worker that lost its lease (its attempt was failed and retried elsewhere)
    changes nothing."""

    task_instance_id: int
    try_number: int
    worker: str

    def fence(self) -> tuple[ColumnElement[bool], ...]:
        return (TI.try_number == self.try_number, TI.worker == self.worker)


@dataclass(frozen=True)
class Started:
    """An attempt that start_many moved to running, with what its request needs of its run
    (``run_exists`` False: the run is gone; its fields are then None)."""

    id: int
    dag_id: str
    run_id: str
    task_id: str
    map_index: int
    try_number: int
    max_tries: int
    first_started_at: dt.datetime
    next_method: str | None
    next_kwargs: str | None
    next_event: str | None
    run_exists: bool
    logical_date: dt.datetime | None
    conf: dict[str, Any] | None
    data_interval_start: dt.datetime | None
    data_interval_end: dt.datetime | None
    run_type: str | None
    partition_key: str | None


def _try_rows_of_moved(given: str) -> str:
    """The CTE ``try_rows``: the size rows of the moved tries created or locked in key order,
    when the parameter ``given`` (the line to write next) is set."""
    return f"""
    try_rows AS (
        INSERT INTO task_log_try (task_instance_id, try_number)
        SELECT id, try_number FROM moved WHERE CAST(:{given} AS text) IS NOT NULL ORDER BY id
        ON CONFLICT (task_instance_id, try_number) DO UPDATE SET bytes = task_log_try.bytes
        WHERE false
        RETURNING 1
    )"""


# Plain SQL, one statement: it is on every attempt's path (the ORM's building of it cost more
# than its execution). A new try starts with no XCom left over from an earlier one. The try's
# start line is written by the same statement, as tasklogs.append writes a worker's lines: the
# tries' size rows created or locked in key order first, the lines' ids drawn once they are
# held (the count over ``try_rows`` is computed before the first line is made).
_START_SQL = text(
    """
    WITH moved AS (
        UPDATE task_instance AS ti
        SET state = 'running', hostname = :hostname, worker = :worker,
            start_date = COALESCE(ti.start_date, now()),
            first_started_at = COALESCE(ti.first_started_at, now()),
            updated_at = now()
        FROM unnest(CAST(:ids AS bigint[]), CAST(:tries AS integer[])) AS a (id, try_number)
        WHERE ti.id = a.id AND ti.try_number = a.try_number AND ti.state = 'queued'
        RETURNING ti.id, ti.dag_id, ti.run_id, ti.task_id, ti.map_index, ti.try_number,
                  ti.max_tries, ti.first_started_at, ti.next_method, ti.next_kwargs,
                  ti.next_event
    ), recorded AS (
        INSERT INTO task_state_change (task_instance_id, from_state, to_state, reason)
        SELECT id, 'queued', 'running',
               CASE WHEN next_method IS NULL THEN 'picked up' ELSE 'resumed' END
        FROM moved ORDER BY id
    ), cleared AS (
        DELETE FROM xcom WHERE task_instance_id IN (SELECT id FROM moved WHERE next_method IS NULL)
    ),"""
    + _try_rows_of_moved("started_by")
    + """, start_lines AS (
        INSERT INTO task_log (task_instance_id, try_number, at, source, text)
        SELECT moved.id, moved.try_number, now(), :source,
               'try ' || moved.try_number || ' started ' || :started_by
               || COALESCE(', resuming at ' || moved.next_method, '')
        FROM (SELECT count(*) FROM try_rows) AS locked, moved
        WHERE CAST(:started_by AS text) IS NOT NULL
        ORDER BY moved.id
    ), adopted AS (
        SELECT ti.id, ti.dag_id, ti.run_id, ti.task_id, ti.map_index, ti.try_number,
               ti.max_tries, ti.first_started_at, ti.next_method, ti.next_kwargs,
               ti.next_event
        FROM task_instance AS ti
        JOIN unnest(CAST(:adopt_ids AS bigint[]), CAST(:adopt_tries AS integer[]))
            AS a (id, try_number) ON ti.id = a.id AND ti.try_number = a.try_number
        WHERE ti.state = 'running' AND ti.worker = :worker
    )
    SELECT started.*, run.id IS NOT NULL AS run_exists, run.logical_date, run.conf,
           run.data_interval_start, run.data_interval_end, run.run_type,
           run.partition_key
    FROM (SELECT * FROM moved UNION ALL SELECT * FROM adopted) AS started
    LEFT JOIN dag_run AS run ON run.dag_id = started.dag_id AND run.run_id = started.run_id
    ORDER BY started.id
    """
)


# What _START_SQL returns for a task instance, read without moving it.
_PREVIEW_SQL = text(
    """
    SELECT ti.id, ti.dag_id, ti.run_id, ti.task_id, ti.map_index, ti.try_number, ti.max_tries,
           COALESCE(ti.first_started_at, now()) AS first_started_at, ti.next_method,
           ti.next_kwargs, ti.next_event, run.id IS NOT NULL AS run_exists, run.logical_date,
           run.conf, run.data_interval_start, run.data_interval_end, run.run_type,
           run.partition_key
    FROM task_instance AS ti
    LEFT JOIN dag_run AS run ON run.dag_id = ti.dag_id AND run.run_id = ti.run_id
    WHERE ti.id = :id
    """
)


def preview_start(session: Session, ti_id: int) -> Started | None:
    """What :func:`start_many` would return for the task instance, without starting it (no
    state changes): ``deferral tasks test`` runs an attempt that records nothing."""
    row = session.execute(_PREVIEW_SQL, {"id": ti_id}).one_or_none()
    return None if row is None else Started(**row._mapping)


def start_many(
    session: Session,
    attempts: Sequence[tuple[int, int]],
    hostname: str,
    worker: str,
    started_by: str | None = None,
    adopting: Sequence[tuple[int, int]] = (),
) -> list[Started]:
    """queued -> running for each (task instance id, try number) a queue message names, only at
    that try: a duplicate or stale message moves nothing, so no attempt ever runs twice. One
    statement for the whole batch, which also reads the attempts' runs and, given
    ``started_by`` (who started them, e.g. ``on worker w1 (host)``), writes each try's start
    line: "try N started <started_by>[, resuming at <method>]".

    ``adopting``: attempts (of ``attempts``) whose earlier start may have committed though its
    answer was lost with the connection (worker rule 28). One found running at that try on
    ``worker`` is returned as started, as it is: its start was this worker's, and nothing runs
    it. The caller leaves out the attempts it runs or has run."""
    if not attempts:
        return []
    params = {
        "ids": [a[0] for a in attempts],
        "tries": [a[1] for a in attempts],
        "adopt_ids": [a[0] for a in adopting],
        "adopt_tries": [a[1] for a in adopting],
        "hostname": hostname,
        "worker": worker,
        "started_by": None if started_by is None else tasklogs.clean(started_by),
        "source": tasklogs.SOURCE_WORKER,
    }
    started = [Started(**row._mapping) for row in session.execute(_START_SQL, params)]
    _expire_loaded(session, [s.id for s in started])
    return started


_END_OF_ATTEMPT: dict[str, Any] = {
    "next_method": None,
    "next_kwargs": None,
    "next_event": None,
    "trigger_timeout": None,
}


def succeed(session: Session, attempt: Attempt, return_value: Any) -> bool:
    """running -> success; ``return_value`` (to_jsonable form) becomes XCom return_value."""
    return bool(succeed_many(session, [(attempt, return_value)]))


def _fenced(attempts: Sequence[Attempt]) -> ColumnElement[bool]:
    return tuple_(TI.id, TI.try_number, TI.worker).in_(
        [(a.task_instance_id, a.try_number, a.worker) for a in attempts]
    )


# running -> success for a batch of attempts (fenced on try and worker), recorded, their runs
# marked, their return values written as XCom, and (given :said) the line saying so in each
# try's log: one statement, on every success's path.
_SUCCEED_SQL = text(
    """
    WITH moved AS (
        UPDATE task_instance AS ti
        SET state = 'success', end_date = now(), updated_at = now(),
            next_method = NULL, next_kwargs = NULL, next_event = NULL, trigger_timeout = NULL
        FROM unnest(CAST(:ids AS bigint[]), CAST(:tries AS integer[]),
                    CAST(:workers AS text[]), CAST(:values AS jsonb[]))
            AS r (id, try_number, worker, value)
        WHERE ti.id = r.id AND ti.try_number = r.try_number AND ti.worker = r.worker
            AND ti.state = 'running'
        RETURNING ti.id, ti.try_number, ti.dag_id, ti.run_id, ti.task_id, ti.map_index, r.value
    ), recorded AS (
        INSERT INTO task_state_change (task_instance_id, from_state, to_state, reason)
        SELECT id, 'running', 'success', 'returned' FROM moved ORDER BY id
    ),"""
    + _try_rows_of_moved("said")
    + """, said_lines AS (
        INSERT INTO task_log (task_instance_id, try_number, at, source, text)
        SELECT moved.id, moved.try_number, now(), :source, :said
        FROM (SELECT count(*) FROM try_rows) AS locked, moved
        WHERE CAST(:said AS text) IS NOT NULL
        ORDER BY moved.id
    ), xcoms AS (
        INSERT INTO xcom (task_instance_id, key, value)
        SELECT id, 'return_value', value FROM moved WHERE value IS NOT NULL
        ON CONFLICT (task_instance_id, key) DO UPDATE SET value = excluded.value
    ),"""
    + OUTLET_EVENTS_OF_MOVED
    + MARK_RUNS_OF_MOVED
    + """
    SELECT id, false AS event FROM moved
    UNION ALL
    SELECT id, true FROM outlet_events
    """
)


def succeed_many(session: Session, results: Sequence[tuple[Attempt, Any]]) -> set[int]:
    """:func:`succeed` for a batch, in one statement; returns the ids that moved."""
    return succeed_recording(session, results)[0]


def succeed_recording(
    session: Session, results: Sequence[tuple[Attempt, Any]], *, said: str | None = None
) -> tuple[set[int], list[int]]:
    """:func:`succeed_many`, also returning the ids of the outlet events the successes
    recorded (their waiters are resumed next, ``deferral.store.waits.resume_asset_waiters``).
    Given ``said``, the worker's line in the log of each try that moved, by the same
    statement (a statement less on every success's path)."""
    if not results:
        return set(), []
    params = {
        "ids": [a.task_instance_id for a, _ in results],
        "tries": [a.try_number for a, _ in results],
        "workers": [a.worker for a, _ in results],
        "values": [None if v is None else json.dumps(v) for _, v in results],
        "said": None if said is None else tasklogs.clean(said),
        "source": tasklogs.SOURCE_WORKER,
    }
    rows = session.execute(_SUCCEED_SQL, params).all()
    moved = {row.id for row in rows if not row.event}
    _expire_loaded(session, moved)
    return moved, [row.id for row in rows if row.event]


def skip(session: Session, attempt: Attempt, reason: str) -> bool:
    return bool(
        _move(
            session,
            [attempt.task_instance_id],
            TaskState.RUNNING,
            TaskState.SKIPPED,
            reason,
            fence=attempt.fence(),
            end_date=func.now(),
            **_END_OF_ATTEMPT,
        )
    )


def has_tries_left(try_number: int, max_tries: int) -> bool:
    """Whether a failed try may be retried: max_tries counts the retries after the first try."""
    return try_number <= max_tries


def fail(
    session: Session,
    attempt: Attempt,
    error: str,
    *,
    allow_retry: bool,
    retry_delay: dt.timedelta | None = None,
) -> TaskState | None:
    """running -> up_for_retry (tries left and allowed; the next try is due after
    ``retry_delay``, or when the scheduler has computed it if None) or failed; returns the new
    state, or None if this attempt no longer runs."""
    tries = session.execute(
        select(TI.try_number, TI.max_tries)
        .where(TI.id == attempt.task_instance_id, TI.state == TaskState.RUNNING, *attempt.fence())
        .with_for_update()
    ).one_or_none()
    if tries is None:
        return None
    if allow_retry and has_tries_left(tries.try_number, tries.max_tries):
        due_at = None if retry_delay is None else func.now() + retry_delay
        to_state, values = TaskState.UP_FOR_RETRY, {"due_at": due_at}
    else:
        to_state, values = TaskState.FAILED, {}
    _move(
        session,
        [attempt.task_instance_id],
        TaskState.RUNNING,
        to_state,
        error,
        fence=attempt.fence(),
        end_date=func.now(),
        **_END_OF_ATTEMPT,
        **values,
    )
    return to_state


def hand_back(session: Session, attempts: Sequence[Attempt], reason: str) -> list[int]:
    """running -> scheduled at the same try, for attempts their worker stopped before they
    ended (its stop grace ran out): no try is counted, the scheduler queues them again, and a
    resumed attempt keeps its resume point so it resumes again. Fenced on try and worker: an
    attempt already failed over or ended moves nothing. Returns the ids moved."""
    moved: list[int] = []
    for attempt in attempts:
        moved += _move(
            session,
            [attempt.task_instance_id],
            TaskState.RUNNING,
            TaskState.SCHEDULED,
            reason,
            fence=attempt.fence(),
            end_date=None,
        )
    return moved


def fail_poisoned(session: Session, ti_id: int, try_number: int, reason: str) -> bool:
    """queued / running -> failed (no retry) at ``try_number``: its queue entry killed every
    worker that took it."""
    for from_state in (TaskState.QUEUED, TaskState.RUNNING):
        moved = _move(
            session,
            [ti_id],
            from_state,
            TaskState.FAILED,
            reason,
            fence=(TI.try_number == try_number,),
            end_date=func.now(),
            **_END_OF_ATTEMPT,
        )
        if moved:
            return True
    return False


def reschedule(session: Session, attempt: Attempt, reschedule_date: dt.datetime) -> bool:
    """running -> up_for_reschedule until ``reschedule_date`` (same try; the slot is freed)."""
    ti = session.get(TI, attempt.task_instance_id)
    moved = _move(
        session,
        [attempt.task_instance_id],
        TaskState.RUNNING,
        TaskState.UP_FOR_RESCHEDULE,
        f"poke again at {reschedule_date.isoformat()}",
        fence=attempt.fence(),
        end_date=func.now(),
        due_at=reschedule_date,
    )
    if moved and ti is not None:
        session.add(
            TaskReschedule(
                task_instance_id=attempt.task_instance_id,
                try_number=attempt.try_number,
                start_date=ti.start_date or func.now(),
                end_date=func.now(),
                reschedule_date=reschedule_date,
            )
        )
    return bool(moved)
