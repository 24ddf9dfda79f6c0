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
import json
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import (
    CTE,
    ColumnElement,
    Integer,
    Row,
    String,
    Table,
    bindparam,
    delete,
    func,
    insert,
    literal,
    select,
    text,
    tuple_,
    update,
)
from sqlalchemy.dialects.postgresql import ARRAY
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.orm import Session
from sqlalchemy.orm.util import identity_key

from deferral.crypto import Cipher
from deferral.models import (
    DagRun,
    TaskInstance,
    TaskReschedule,
    TaskStateChange,
    Trigger,
)
from deferral.states import FAIL_METHOD, FINISHED_STATES, DagRunState, DagRunType, TaskState
from deferral.tasklogs import NewLine

TI = TaskInstance
# Core tables: executemany UPDATEs keyed by bound parameters are not ORM bulk updates.
_TI_TABLE: Table = TaskInstance.__table__  # type: ignore[assignment]

# Reasons recorded when a task leaves the deferred state; the triggerer reads them to tell why
# the trigger it runs is no longer wanted.
TIMED_OUT = "trigger timeout passed"
RESUMED_BY_TRIGGER = "trigger "  # "trigger <id> fired" / "trigger <id> failed"

# Reaching one of these states may let the run move on (downstream tasks become decidable, the run
# may finish, a retry needs its due time): the run is marked for evaluation in the same statement.
MARKS_RUN = frozenset({*FINISHED_STATES, TaskState.NONE, TaskState.UP_FOR_RETRY})


def _mark_runs_of(moved: CTE) -> CTE:
    """A CTE marking the running runs of the task instances in ``moved`` for evaluation.

    Every such run row is written, even one already marked: a run being evaluated is row-locked
    by the scheduler, which clears its mark when done. Skipping an already-marked run would let
    that clear erase this change unseen (the scheduler read the tasks before this commit), and the
    run would wait for ever. Writing waits for the lock instead, then marks the run again. Runs are
    locked in id order so that two batches touching the same runs cannot deadlock."""
    to_mark = (
        select(DagRun.id)
        .join(moved, (DagRun.dag_id == moved.c.dag_id) & (DagRun.run_id == moved.c.run_id))
        .where(DagRun.state == DagRunState.RUNNING)
        .order_by(DagRun.id)
        .with_for_update(of=DagRun)
        .cte("to_mark")
    )
    return (
        update(DagRun)
        .where(DagRun.id.in_(select(to_mark.c.id)), DagRun.state == DagRunState.RUNNING)
        # An earlier mark keeps its place in the scheduler's queue.
        .values(
            evaluate_after=func.least(func.coalesce(DagRun.evaluate_after, func.now()), func.now())
        )
        .cte("marked")
    )


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
        statement = statement.add_cte(_mark_runs_of(moved))
    moved_ids = list(session.scalars(statement))
    _expire_loaded(session, moved_ids)
    return moved_ids


def _expire_loaded(session: Session, ids: Iterable[int]) -> None:
    """Core statements bypass the ORM: rows of these ids already loaded in the session are
    reloaded on their next access."""
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


# -- DAG runs ------------------------------------------------------------------------------------


def create_dag_run(
    session: Session,
    dag_id: str,
    run_id: str,
    logical_date: dt.datetime,
    conf: Mapping[str, Any],
    *,
    run_type: str = "manual",
    data_interval: tuple[dt.datetime, dt.datetime] | None = None,
) -> int:
    """A new run in state queued, marked for the scheduler to start."""
    start, end = data_interval if data_interval is not None else (None, None)
    run = DagRun(
        dag_id=dag_id,
        run_id=run_id,
        run_type=run_type,
        logical_date=logical_date,
        data_interval_start=start,
        data_interval_end=end,
        state=DagRunState.QUEUED,
        conf=conf,
        evaluate_after=func.now(),
    )
    session.add(run)
    session.flush()
    return run.id


@dataclass(frozen=True)
class NewDagRun:
    """A scheduled or backfill run to create (queued)."""

    dag_id: str
    run_type: DagRunType
    logical_date: dt.datetime
    data_interval_start: dt.datetime
    data_interval_end: dt.datetime
    conf: Mapping[str, Any] = field(default_factory=dict)

    @property
    def run_id(self) -> str:
        return self.run_type.run_id(self.logical_date)


def create_dag_runs_once(session: Session, runs: Sequence[NewDagRun]) -> list[str]:
    """Create the runs no run of their DAG has the logical date (or run id) of yet; return the
    run ids created. The unique keys decide, not a lock: replicas racing to create the same run
    create it once, the loser's insert does nothing."""
    if not runs:
        return []
    rows = [
        {
            "dag_id": r.dag_id,
            "run_id": r.run_id,
            "run_type": r.run_type,
            "logical_date": r.logical_date,
            "data_interval_start": r.data_interval_start,
            "data_interval_end": r.data_interval_end,
            "state": DagRunState.QUEUED,
            "conf": dict(r.conf),
            "evaluate_after": func.now(),
        }
        for r in runs
    ]
    statement = pg_insert(DagRun).values(rows).on_conflict_do_nothing().returning(DagRun.run_id)
    return list(session.scalars(statement))


@dataclass(frozen=True)
class NewTaskInstance:
    task_id: str
    max_tries: int
    pool: str
    pool_slots: int
    queue: str
    priority_weight: int
    map_index: int = -1


def start_dag_run(session: Session, run: DagRun, tasks: Sequence[NewTaskInstance]) -> None:
    """queued -> running, creating the run's task instances (state none)."""
    add_task_instances(session, run, tasks)
    run.state = DagRunState.RUNNING
    run.start_date = func.now()
    run.evaluate_after = func.now()


def add_task_instances(
    session: Session, run: DagRun, tasks: Sequence[NewTaskInstance]
) -> list[tuple[int, int]]:
    """Create task instances (state none) for the (task, map index) of the run that have none
    yet; returns the (id, map index) of those created."""
    if not tasks:
        return []
    # One statement of constant shape, the rows as arrays: a VALUES list of a thousand tasks
    # cost the scheduler more to compile than Postgres to insert.
    new = (
        func.unnest(
            _array("task_id", [t.task_id for t in tasks], String),
            _array("map_index", [t.map_index for t in tasks], Integer),
            _array("max_tries", [t.max_tries for t in tasks], Integer),
            _array("pool", [t.pool for t in tasks], String),
            _array("pool_slots", [t.pool_slots for t in tasks], Integer),
            _array("queue", [t.queue for t in tasks], String),
            _array("priority_weight", [t.priority_weight for t in tasks], Integer),
        )
        .table_valued(*_NEW_TI_COLUMNS)
        .render_derived("new")
    )
    statement = (
        pg_insert(TI)
        .from_select(
            ["dag_id", "run_id", *_NEW_TI_COLUMNS],
            select(
                literal(run.dag_id, String),
                literal(run.run_id, String),
                *(new.c[name] for name in _NEW_TI_COLUMNS),
            ),
        )
        .on_conflict_do_nothing()
        .returning(TI.id, TI.map_index)
    )
    return [(row.id, row.map_index) for row in session.execute(statement)]


_NEW_TI_COLUMNS = (
    "task_id",
    "map_index",
    "max_tries",
    "pool",
    "pool_slots",
    "queue",
    "priority_weight",
)


def _array(name: str, items: list[Any], item_type: Any) -> Any:
    """A bound array parameter (an unnest() column)."""
    return bindparam(name, items, type_=ARRAY(item_type))


def expand_mapped_task(
    session: Session, run: DagRun, placeholder_id: int, more: Sequence[NewTaskInstance]
) -> list[tuple[int, int]]:
    """A mapped task's placeholder (map index -1, state none) becomes map index 0, and task
    instances are created for ``more`` (map indexes 1..n-1, state none), at most once however
    many schedulers evaluate the run: the placeholder's conditional update decides, and only
    the statement that moved it creates the others. Returns the (id, map index) of the task
    instances of the expansion, or nothing if the placeholder was no longer waiting."""
    moved = session.scalars(
        update(TI)
        .where(TI.id == placeholder_id, TI.map_index == -1, TI.state == TaskState.NONE)
        .values(map_index=0, updated_at=func.now())
        .returning(TI.id)
    ).one_or_none()
    if moved is None:
        return []
    _expire_loaded(session, [placeholder_id])
    count = len(more) + 1
    session.add(
        TaskStateChange(
            task_instance_id=placeholder_id,
            from_state=TaskState.NONE,
            to_state=TaskState.NONE,
            reason=f"expanded into {count} task instance(s), map indexes 0 to {count - 1}",
        )
    )
    return [(placeholder_id, 0), *add_task_instances(session, run, more)]


def delete_dag_run(session: Session, dag_id: str, run_id: str) -> None:
    """Delete a run and its task instances (their XComs, logs and state changes with them):
    the run ``deferral tasks test`` made for itself."""
    session.execute(delete(TI).where(TI.dag_id == dag_id, TI.run_id == run_id))
    session.execute(delete(DagRun).where(DagRun.dag_id == dag_id, DagRun.run_id == run_id))


def finish_dag_run(session: Session, run: DagRun, state: DagRunState) -> None:
    run.state = state
    run.end_date = func.now()
    run.evaluate_after = None


def evaluated(session: Session, run: DagRun, error: str | None = None) -> None:
    """The scheduler looked at the run: clear its mark, or (``error``) keep it marked for a
    later look, with the reason, so one run that raises does not stop the others."""
    run.scheduling_error = error
    run.evaluate_after = None if error is None else func.now() + dt.timedelta(seconds=30)


DAGRUN_TIMED_OUT = "dagrun_timeout passed"


def time_out_dag_run(session: Session, run_id: int) -> list[int] | None:
    """running -> failed for a run past its dagrun_timeout; its unfinished task instances are
    skipped, as in Airflow 2: a deferred one lets go of its trigger, a running attempt's outcome
    no longer applies (it is fenced on the running state). Returns the task instances skipped,
    or None if the run was not running."""
    run = session.execute(
        update(DagRun)
        .where(DagRun.id == run_id, DagRun.state == DagRunState.RUNNING)
        .values(state=DagRunState.FAILED, end_date=func.now(), evaluate_after=None)
        .returning(DagRun.dag_id, DagRun.run_id)
    ).one_or_none()
    if run is None:
        return None
    unfinished = tuple(s for s in TaskState if s not in FINISHED_STATES)
    return _end_unfinished(
        session, run.dag_id, run.run_id, unfinished, TaskState.SKIPPED, DAGRUN_TIMED_OUT
    )


# -- scheduler: none / up_for_retry -> scheduled -> queued ----------------------------------------

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


# -- worker: queued -> running -> success / failed / up_for_retry / skipped / deferred ------------


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


# Plain SQL, one statement: it is on every attempt's path (the ORM's building of it cost more
# than its execution). A new try starts with no XCom left over from an earlier one.
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
    )
    SELECT moved.*, run.id IS NOT NULL AS run_exists, run.logical_date, run.conf,
           run.data_interval_start, run.data_interval_end, run.run_type
    FROM moved
    LEFT JOIN dag_run AS run ON run.dag_id = moved.dag_id AND run.run_id = moved.run_id
    ORDER BY moved.id
    """
)


# What _START_SQL returns for a task instance, read without moving it.
_PREVIEW_SQL = text(
    """
    SELECT ti.id, ti.dag_id, ti.run_id, ti.task_id, ti.map_index, ti.try_number, ti.max_tries,
           COALESCE(ti.first_started_at, now()) AS first_started_at, ti.next_method,
           ti.next_kwargs, ti.next_event, run.id IS NOT NULL AS run_exists, run.logical_date,
           run.conf, run.data_interval_start, run.data_interval_end, run.run_type
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
    session: Session, attempts: Sequence[tuple[int, int]], hostname: str, worker: str
) -> list[Started]:
    """queued -> running for each (task instance id, try number) a queue message names, only at
    that try: a duplicate or stale message moves nothing, so no attempt ever runs twice. One
    statement for the whole batch, which also reads the attempts' runs."""
    if not attempts:
        return []
    params = {
        "ids": [a[0] for a in attempts],
        "tries": [a[1] for a in attempts],
        "hostname": hostname,
        "worker": worker,
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


# The runs of the task instances in ``moved`` marked for evaluation (plain SQL, as
# :func:`_mark_runs_of` builds it: every running run row written, locked in id order).
_MARK_RUNS_OF_MOVED = """
    to_mark AS (
        SELECT run.id FROM dag_run AS run
        JOIN moved ON run.dag_id = moved.dag_id AND run.run_id = moved.run_id
        WHERE run.state = 'running'
        ORDER BY run.id
        FOR UPDATE OF run
    ), marked AS (
        UPDATE dag_run
        SET evaluate_after = LEAST(COALESCE(evaluate_after, now()), now()), updated_at = now()
        WHERE id IN (SELECT id FROM to_mark) AND state = 'running'
    )
"""

# running -> success for a batch of attempts (fenced on try and worker), recorded, their runs
# marked, their return values written as XCom: one statement, on every success's path.
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
        RETURNING ti.id, ti.dag_id, ti.run_id, r.value
    ), recorded AS (
        INSERT INTO task_state_change (task_instance_id, from_state, to_state, reason)
        SELECT id, 'running', 'success', 'returned' FROM moved ORDER BY id
    ), xcoms AS (
        INSERT INTO xcom (task_instance_id, key, value)
        SELECT id, 'return_value', value FROM moved WHERE value IS NOT NULL
        ON CONFLICT (task_instance_id, key) DO UPDATE SET value = excluded.value
    ),"""
    + _MARK_RUNS_OF_MOVED
    + """
    SELECT id FROM moved
    """
)


def succeed_many(session: Session, results: Sequence[tuple[Attempt, Any]]) -> set[int]:
    """:func:`succeed` for a batch, in one statement; returns the ids that moved."""
    if not results:
        return set()
    params = {
        "ids": [a.task_instance_id for a, _ in results],
        "tries": [a.try_number for a, _ in results],
        "workers": [a.worker for a, _ in results],
        "values": [None if v is None else json.dumps(v) for _, v in results],
    }
    moved = set(session.scalars(_SUCCEED_SQL, params))
    _expire_loaded(session, moved)
    return moved


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
            TI.dag_id == chooser.dag_id,
            TI.run_id == chooser.run_id,
            TI.task_id.in_(task_ids),
        )
    ).all()
    reason = f"skipped by {chooser.task_id}"
    return [
        ti_id
        for from_state in (TaskState.NONE, TaskState.SCHEDULED)
        for ti_id in _move(session, ids, from_state, TaskState.SKIPPED, reason, end_date=func.now())
    ]


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


def create_trigger(session: Session, classpath: str, kwargs_token: str) -> int:
    trigger = Trigger(classpath=classpath, kwargs=kwargs_token)
    session.add(trigger)
    session.flush()
    return trigger.id


def drop_trigger(session: Session, trigger_id: int) -> None:
    """Delete a trigger no task waits on (its deferral did not happen)."""
    session.execute(delete(Trigger).where(Trigger.id == trigger_id))


@dataclass(frozen=True)
class Deferral:
    """What one attempt's deferral writes: its trigger row and the task's resume point."""

    attempt: Attempt
    classpath: str
    kwargs_token: str  # the trigger's kwargs, sealed
    next_method: str
    next_kwargs_token: str
    trigger_timeout: dt.datetime | None


def defer(
    session: Session,
    attempt: Attempt,
    *,
    trigger_id: int,
    next_method: str,
    next_kwargs_token: str,
    trigger_timeout: dt.datetime | None,
) -> bool:
    """running -> deferred, waiting on an existing trigger row ``trigger_id``."""
    return bool(
        _move(
            session,
            [attempt.task_instance_id],
            TaskState.RUNNING,
            TaskState.DEFERRED,
            f"deferred to trigger {trigger_id}",
            fence=attempt.fence(),
            trigger_id=trigger_id,
            next_method=next_method,
            next_kwargs=next_kwargs_token,
            next_event=None,
            trigger_timeout=trigger_timeout,
        )
    )


# running -> deferred for a batch (fenced on try and worker): the rows locked, a trigger row
# for each that moves (its id drawn first, so that each task gets its own), the moves and their
# records; one statement, on every deferral's path. Nothing is written for an attempt that no
# longer holds its task instance.
_DEFER_SQL = text(
    """
    WITH deferral AS (
        SELECT * FROM unnest(
            CAST(:ids AS bigint[]), CAST(:tries AS integer[]), CAST(:workers AS text[]),
            CAST(:next_methods AS text[]), CAST(:next_kwargs AS text[]),
            CAST(:timeouts AS timestamptz[]), CAST(:classpaths AS text[]),
            CAST(:kwargs AS text[])
        ) AS d (id, try_number, worker, next_method, next_kwargs, trigger_timeout, classpath,
                kwargs)
    ), held AS (
        SELECT ti.id FROM task_instance AS ti
        JOIN deferral AS d ON ti.id = d.id AND ti.try_number = d.try_number
            AND ti.worker = d.worker
        WHERE ti.state = 'running'
        ORDER BY ti.id
        FOR UPDATE OF ti
    ), planned AS (
        SELECT d.*, nextval(pg_get_serial_sequence('trigger', 'id')) AS trigger_id
        FROM deferral AS d JOIN held ON held.id = d.id
    ), triggers AS (
        INSERT INTO trigger (id, classpath, kwargs)
        SELECT trigger_id, classpath, kwargs FROM planned
    ), moved AS (
        UPDATE task_instance AS ti
        SET state = 'deferred', trigger_id = p.trigger_id, next_method = p.next_method,
            next_kwargs = p.next_kwargs, next_event = NULL, trigger_timeout = p.trigger_timeout,
            updated_at = now()
        FROM planned AS p
        WHERE ti.id = p.id
        RETURNING ti.id, ti.trigger_id
    ), recorded AS (
        INSERT INTO task_state_change (task_instance_id, from_state, to_state, reason)
        SELECT id, 'running', 'deferred', 'deferred to trigger ' || trigger_id
        FROM moved ORDER BY id
    )
    SELECT id, trigger_id FROM moved
    """
)


def defer_many(session: Session, deferrals: Sequence[Deferral]) -> dict[int, int]:
    """running -> deferred for a batch, each with a new trigger row, in one statement; returns
    task instance id -> trigger id for those that moved."""
    if not deferrals:
        return {}
    params = {
        "ids": [d.attempt.task_instance_id for d in deferrals],
        "tries": [d.attempt.try_number for d in deferrals],
        "workers": [d.attempt.worker for d in deferrals],
        "next_methods": [d.next_method for d in deferrals],
        "next_kwargs": [d.next_kwargs_token for d in deferrals],
        "timeouts": [d.trigger_timeout for d in deferrals],
        "classpaths": [d.classpath for d in deferrals],
        "kwargs": [d.kwargs_token for d in deferrals],
    }
    done = {ti_id: trigger_id for ti_id, trigger_id in session.execute(_DEFER_SQL, params)}
    _expire_loaded(session, done)
    return done


# -- awaiting input (human in the loop) ----------------------------------------------------------
#
# | from           | event                          | to             | who                       |
# | running        | HITLOperator asks (execute)    | awaiting_input | worker                    |
# | awaiting_input | a person responds              | scheduled      | web UI / API / CLI        |
# | awaiting_input | response timeout passed        | scheduled      | scheduler (SKIP LOCKED)   |
# | awaiting_input | task cleared / marked          | none / ...     | CLI / web UI              |
#
# A task awaiting input holds no worker slot, no pool slot and no trigger; it resumes at
# ``execute_complete`` with the response as its event (``deferral.hitl``).


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


# -- scheduler: deferred -> scheduled ------------------------------------------------------------


@dataclass(frozen=True)
class FiredEvent:
    dedup_key: str
    trigger_id: int
    failed: bool  # the trigger failed (raised, ended without an event, could not be built)
    payload: Any  # the event payload, or for a failure {"error": ..., "traceback": ...}
    # The triggerer's lines for the try's log, stored by whoever applies the event.
    log: tuple[NewLine, ...] = ()
    # The payload sealed as the triggerer sent it, stored as it is (else sealed here).
    sealed_payload: str | None = None


@dataclass(frozen=True)
class Resumed:
    """What an event did: its outcome as recorded in resume_event (applied, duplicate, stale)
    and the task instance it resumed, if it did."""

    outcome: str
    task_instance_id: int | None = None


def resume(session: Session, event: FiredEvent, cipher: Cipher) -> Resumed:
    """:func:`resume_many` for one event."""
    return resume_many(session, [event], cipher)[0]


def resume_point(
    event: FiredEvent, next_method: str | None, next_kwargs: dict[str, Any]
) -> tuple[str | None, dict[str, Any]]:
    """The method and kwargs a task that deferred with ``next_method`` and ``next_kwargs``
    resumes at when ``event`` fires: the method with the event, or ``__fail__`` with the
    trigger's failure."""
    if event.failed:
        return FAIL_METHOD, {"error": "trigger_failure", **event.payload}
    return next_method, {**next_kwargs, "event": event.payload}


def _resumed_at(
    event: FiredEvent, next_method: str | None, next_kwargs: str | None, cipher: Cipher
) -> tuple[str | None, str | None, str | None, str]:
    """(next_method, sealed next_kwargs, sealed next_event, reason) of a task resumed by
    ``event``, given what it deferred with. The kwargs it deferred with are kept as they were
    sealed and the event goes beside them, so nothing is opened and sealed again here."""
    if event.failed:
        kwargs = {"error": "trigger_failure", **event.payload}
        return (
            FAIL_METHOD,
            cipher.seal(kwargs, "next_kwargs"),
            None,
            f"{RESUMED_BY_TRIGGER}{event.trigger_id} failed",
        )
    sealed_event = event.sealed_payload or cipher.seal(event.payload, "event")
    return (
        next_method,
        next_kwargs,
        sealed_event,
        f"{RESUMED_BY_TRIGGER}{event.trigger_id} fired",
    )


# The kwargs a task whose deferral timed out resumes at ``__fail__`` with.
TIMED_OUT_KWARGS = {"error": "timeout"}


# Lock the tasks deferred on the events' triggers, then claim each event's dedup key (a key seen
# before claims nothing: a duplicate) with its outcome already decided: applied by the first
# event of a trigger whose task waits, stale for the others. The key is claimed before the task
# is touched (by _RESUME_SQL, only for the keys claimed as applied), and written once: no second
# write to say it applied. Plain SQL, as for every statement on the resume path: it runs once
# per batch of events, and building it with the ORM cost more than executing it.
_CLAIM_EVENTS_SQL = text(
    """
    WITH fired AS (
        SELECT * FROM unnest(CAST(:dedup_keys AS text[]), CAST(:trigger_ids AS bigint[]))
            WITH ORDINALITY AS f (dedup_key, trigger_id, n)
    ), waiting AS (
        SELECT id, trigger_id, next_method, next_kwargs FROM task_instance
        WHERE state = 'deferred' AND trigger_id IN (SELECT trigger_id FROM fired)
        ORDER BY id
        FOR UPDATE
    ), appliers AS (
        SELECT DISTINCT ON (fired.trigger_id) fired.dedup_key, waiting.id
        FROM fired JOIN waiting ON waiting.trigger_id = fired.trigger_id
        ORDER BY fired.trigger_id, fired.n
    ), claimed AS (
        INSERT INTO resume_event (dedup_key, trigger_id, outcome, task_instance_id)
        SELECT fired.dedup_key, fired.trigger_id,
               CASE WHEN appliers.id IS NULL THEN 'stale' ELSE 'applied' END, appliers.id
        FROM fired LEFT JOIN appliers ON appliers.dedup_key = fired.dedup_key
        ORDER BY fired.n
        ON CONFLICT DO NOTHING
        RETURNING dedup_key, task_instance_id
    )
    SELECT claimed.dedup_key, waiting.id, waiting.next_method, waiting.next_kwargs
    FROM claimed LEFT JOIN waiting ON waiting.id = claimed.task_instance_id
    """
)

# deferred -> scheduled for the locked tasks, their change recorded, their triggers dropped:
# one statement.
_RESUME_SQL = text(
    """
    WITH resumed AS (
        UPDATE task_instance AS ti
        SET state = 'scheduled', trigger_id = NULL, trigger_timeout = NULL,
            next_method = r.next_method, next_kwargs = r.next_kwargs,
            next_event = r.next_event, updated_at = now()
        FROM unnest(
            CAST(:ids AS bigint[]), CAST(:next_methods AS text[]), CAST(:next_kwargs AS text[]),
            CAST(:next_events AS text[]), CAST(:reasons AS text[]), CAST(:trigger_ids AS bigint[])
        ) AS r (id, next_method, next_kwargs, next_event, reason, trigger_id)
        WHERE ti.id = r.id
        RETURNING ti.id, r.reason, r.trigger_id
    ), recorded AS (
        INSERT INTO task_state_change (task_instance_id, from_state, to_state, reason)
        SELECT id, 'deferred', 'scheduled', reason FROM resumed ORDER BY id
    )
    DELETE FROM trigger WHERE id IN (SELECT trigger_id FROM resumed)
    """
)


def resume_many(session: Session, events: Sequence[FiredEvent], cipher: Cipher) -> list[Resumed]:
    """deferred -> scheduled for the tasks waiting on the events' triggers, at most once per
    dedup key, in two statements whatever the batch size. Returns what each event did:
    applied, duplicate (key seen before) or stale (its task was cleared, timed out, or resumed
    by an earlier event)."""
    if not events:
        return []
    outcomes = [Resumed("duplicate")] * len(events)
    first: dict[str, int] = {}
    for index, event in enumerate(events):
        first.setdefault(event.dedup_key, index)
    keys = list(first)
    claimed = {
        row.dedup_key: row
        for row in session.execute(
            _CLAIM_EVENTS_SQL,
            {"dedup_keys": keys, "trigger_ids": [events[first[k]].trigger_id for k in keys]},
        )
    }
    moves: dict[str, list[Any]] = {
        name: []
        for name in ("ids", "next_methods", "next_kwargs", "next_events", "reasons", "trigger_ids")
    }
    for key in sorted(claimed, key=first.__getitem__):
        row = claimed[key]
        if row.id is None:  # claimed as stale
            outcomes[first[key]] = Resumed("stale")
            continue
        event = events[first[key]]
        resumed_at = _resumed_at(event, row.next_method, row.next_kwargs, cipher)
        values = (row.id, *resumed_at, event.trigger_id)
        for name, value in zip(moves, values, strict=True):
            moves[name].append(value)
        outcomes[first[key]] = Resumed("applied", row.id)
    if moves["ids"]:
        session.execute(_RESUME_SQL, moves)
    return outcomes


_EXPIRE_SQL = """
    WITH expired AS (
        UPDATE task_instance AS ti
        SET state = 'scheduled', trigger_id = NULL, trigger_timeout = NULL,
            next_method = :fail_method, next_kwargs = :fail_kwargs, next_event = NULL,
            updated_at = now()
        FROM (
            SELECT id, trigger_id FROM task_instance
            WHERE state = 'deferred' AND trigger_timeout < now() {among}
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
_EXPIRE_ALL_SQL = text(_EXPIRE_SQL.format(among=""))
_EXPIRE_AMONG_SQL = text(_EXPIRE_SQL.format(among="AND id = ANY(CAST(:among AS bigint[]))"))


def expire_deferrals(
    session: Session, cipher: Cipher, limit: int = 10_000, among: Collection[int] | None = None
) -> list[int]:
    """deferred -> scheduled at ``__fail__`` for every task (``among`` these ids, if given)
    whose trigger_timeout passed, in one statement; the worker then raises TaskDeferralTimeout
    inside the task."""
    token = cipher.seal(TIMED_OUT_KWARGS, "next_kwargs")
    params = {"fail_method": FAIL_METHOD, "fail_kwargs": token, "limit": limit, "reason": TIMED_OUT}
    if among is None:
        return list(session.scalars(_EXPIRE_ALL_SQL, params))
    return list(session.scalars(_EXPIRE_AMONG_SQL, {**params, "among": list(among)}))


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
        due_at=None,
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


# What a run whose DAG no longer loads fails; a running attempt is left to finish (its worker
# loaded the DAG before it broke), and the run fails once it has.
_FAILED_WITH_BROKEN_DAG = (
    TaskState.NONE,
    TaskState.SCHEDULED,
    TaskState.QUEUED,
    TaskState.DEFERRED,
    TaskState.UP_FOR_RETRY,
    TaskState.UP_FOR_RESCHEDULE,
    TaskState.AWAITING_INPUT,
)


def fail_unfinished(session: Session, dag_id: str, run_id: str, reason: str) -> list[int]:
    """Fail every task of a run that is not running or finished (a deferred one lets go of its
    trigger); returns the ids failed."""
    return _end_unfinished(
        session, dag_id, run_id, _FAILED_WITH_BROKEN_DAG, TaskState.FAILED, reason
    )


def _end_unfinished(
    session: Session,
    dag_id: str,
    run_id: str,
    from_states: Sequence[TaskState],
    to_state: TaskState,
    reason: str,
) -> list[int]:
    """Move the tasks of a run that are in ``from_states`` to ``to_state``; deferred ones let go
    of their trigger. Returns the ids moved."""
    rows = session.execute(
        select(TI.id, TI.state, TI.trigger_id).where(
            TI.dag_id == dag_id, TI.run_id == run_id, TI.state.in_(from_states)
        )
    ).all()
    moved: list[int] = []
    for state in from_states:
        moved += _move(
            session,
            [row.id for row in rows if row.state == state],
            state,
            to_state,
            reason,
            end_date=func.now(),
            trigger_id=None,
            due_at=None,
            **_END_OF_ATTEMPT,
        )
    triggers = [row.trigger_id for row in rows if row.id in set(moved) and row.trigger_id]
    if triggers:
        session.execute(delete(Trigger).where(Trigger.id.in_(triggers)))
    return moved


def reopen_dag_run(session: Session, run: DagRun) -> None:
    """A finished run whose tasks were cleared runs again."""
    if run.state in (DagRunState.SUCCESS, DagRunState.FAILED):
        run.state = DagRunState.RUNNING
        run.end_date = None
        run.evaluate_after = func.now()
