"""DAG runs: created, started with their task instances, expanded (mapped tasks), timed
out, finished, reopened; the unfinished tasks of a run ended together."""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import Integer, String, bindparam, delete, func, select, text, update
from sqlalchemy.dialects.postgresql import ARRAY
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.orm import Session
from sqlalchemy.orm.attributes import set_committed_value

from deferral.states import FINISHED_STATES, DagRunState, DagRunType, TaskState
from deferral.store.tables import DagRun, TaskStateChange, Trigger
from deferral.store.transitions.attempts import _END_OF_ATTEMPT
from deferral.store.transitions.core import TI, _expire_loaded, _move


def create_dag_run(
    session: Session,
    dag_id: str,
    run_id: str,
    logical_date: dt.datetime,
    conf: Mapping[str, Any],
    *,
    run_type: str = "manual",
    data_interval: tuple[dt.datetime, dt.datetime] | None = None,
    partition_key: str | None = None,
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
        partition_key=partition_key,
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
    # A PartitionedAssetTimetable's run: the partition key it is for.
    partition_key: str | None = None

    @property
    def run_id(self) -> str:
        return self.run_type.run_id(self.logical_date)


# The runs as arrays, one statement of constant shape however many: a VALUES list took nine
# bound parameters a run, past PostgreSQL's 65,535 at 7,282 runs (a catch-up of 20,000
# minutes failed), and cost the scheduler more to compile than PostgreSQL to insert.
_CREATE_RUNS_SQL = text(
    """
    INSERT INTO dag_run (dag_id, run_id, run_type, logical_date, data_interval_start,
                         data_interval_end, state, conf, partition_key, evaluate_after)
    SELECT r.dag_id, r.run_id, r.run_type, r.logical_date, r.data_interval_start,
        r.data_interval_end, 'queued', CAST(r.conf AS jsonb), r.partition_key, now()
    FROM unnest(CAST(:dag_ids AS text[]), CAST(:run_ids AS text[]), CAST(:run_types AS text[]),
                CAST(:logical_dates AS timestamptz[]), CAST(:starts AS timestamptz[]),
                CAST(:ends AS timestamptz[]), CAST(:confs AS text[]),
                CAST(:partition_keys AS text[]))
        AS r (dag_id, run_id, run_type, logical_date, data_interval_start, data_interval_end,
              conf, partition_key)
    ON CONFLICT DO NOTHING
    RETURNING run_id
    """
)


def create_dag_runs_once(session: Session, runs: Sequence[NewDagRun]) -> list[str]:
    """Create the runs no run of their DAG has the logical date (or run id) of yet; return the
    run ids created. The unique keys decide, not a lock: replicas racing to create the same run
    create it once, the loser's insert does nothing. One statement, whatever the number."""
    if not runs:
        return []
    params = {
        "dag_ids": [r.dag_id for r in runs],
        "run_ids": [r.run_id for r in runs],
        "run_types": [str(r.run_type) for r in runs],
        "logical_dates": [r.logical_date for r in runs],
        "starts": [r.data_interval_start for r in runs],
        "ends": [r.data_interval_end for r in runs],
        "confs": [json.dumps(dict(r.conf)) for r in runs],
        "partition_keys": [r.partition_key for r in runs],
    }
    return list(session.scalars(_CREATE_RUNS_SQL, params))


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


def start_dag_runs(
    session: Session, starts: Sequence[tuple[DagRun, Sequence[NewTaskInstance]]]
) -> None:
    """queued -> running for each run (locked by the caller), creating its task instances
    (state none), marked for evaluation: two statements however many runs start."""
    if not starts:
        return
    _insert_task_instances(
        session, [(run.dag_id, run.run_id, task) for run, tasks in starts for task in tasks]
    )
    session.execute(
        update(DagRun)
        .where(DagRun.id.in_([run.id for run, _ in starts]), DagRun.state == DagRunState.QUEUED)
        .values(state=DagRunState.RUNNING, start_date=func.now(), evaluate_after=func.now()),
        execution_options={"synchronize_session": False},
    )
    for run, _ in starts:
        set_committed_value(run, "state", DagRunState.RUNNING)
        session.expire(run, ["start_date", "evaluate_after", "updated_at"])


def add_task_instances(
    session: Session, run: DagRun, tasks: Sequence[NewTaskInstance]
) -> list[tuple[int, int]]:
    """Create task instances (state none) for the (task, map index) of the run that have none
    yet; returns the (id, map index) of those created."""
    return _insert_task_instances(session, [(run.dag_id, run.run_id, task) for task in tasks])


def _insert_task_instances(
    session: Session, tasks: Sequence[tuple[str, str, NewTaskInstance]]
) -> list[tuple[int, int]]:
    """Create the task instances (state none) of (dag_id, run_id, task) that have none yet;
    returns the (id, map index) of those created."""
    if not tasks:
        return []
    # One statement of constant shape, the rows as arrays: a VALUES list of a thousand tasks
    # cost the scheduler more to compile than Postgres to insert.
    new = (
        func.unnest(
            _array("dag_id", [dag_id for dag_id, _, _ in tasks], String),
            _array("run_id", [run_id for _, run_id, _ in tasks], String),
            _array("task_id", [t.task_id for _, _, t in tasks], String),
            _array("map_index", [t.map_index for _, _, t in tasks], Integer),
            _array("max_tries", [t.max_tries for _, _, t in tasks], Integer),
            _array("pool", [t.pool for _, _, t in tasks], String),
            _array("pool_slots", [t.pool_slots for _, _, t in tasks], Integer),
            _array("queue", [t.queue for _, _, t in tasks], String),
            _array("priority_weight", [t.priority_weight for _, _, t in tasks], Integer),
        )
        .table_valued("dag_id", "run_id", *_NEW_TI_COLUMNS)
        .render_derived("new")
    )
    statement = (
        pg_insert(TI)
        .from_select(
            ["dag_id", "run_id", *_NEW_TI_COLUMNS],
            select(new.c.dag_id, new.c.run_id, *(new.c[name] for name in _NEW_TI_COLUMNS)),
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


def evaluated(
    session: Session, run: DagRun, error: str | None = None, *, again_after_sec: float = 30
) -> None:
    """The scheduler looked at the run: clear its mark, or (``error``) keep it marked for a
    look ``again_after_sec`` later, with the reason, so one run that raises does not stop the
    others."""
    run.scheduling_error = error
    run.evaluate_after = (
        None if error is None else func.now() + dt.timedelta(seconds=again_after_sec)
    )


_EVALUATED_SQL = text(
    """
    UPDATE dag_run SET evaluate_after = NULL, scheduling_error = NULL
    WHERE id = ANY(CAST(:ids AS bigint[]))
    """
)


def evaluated_many(session: Session, runs: Sequence[DagRun]) -> None:
    """:func:`evaluated` without an error, for runs the caller holds locked: one statement of
    a fixed shape however many (the scheduler evaluates runs in batches)."""
    if not runs:
        return
    session.execute(_EVALUATED_SQL, {"ids": [run.id for run in runs]})
    for run in runs:
        set_committed_value(run, "evaluate_after", None)
        set_committed_value(run, "scheduling_error", None)


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
        # A shared trigger stays for its other waiters (drop_unwaited goes after the last).
        session.execute(
            delete(Trigger).where(Trigger.id.in_(triggers), Trigger.share_key.is_(None))
        )
    return moved


def reopen_dag_run(session: Session, run: DagRun) -> None:
    """A finished run whose tasks were cleared runs again."""
    if run.state in (DagRunState.SUCCESS, DagRunState.FAILED):
        run.state = DagRunState.RUNNING
        run.end_date = None
        run.evaluate_after = func.now()
