"""depends_on_past, wait_for_downstream and ignore_first_depends_on_past in the scheduler,
against real Postgres and Redis: a run's task waits on the previous run's, and is let go by the
change in the previous run, with no other event."""

from __future__ import annotations

import datetime as dt
import uuid

import pytest
from sqlalchemy import delete, select
from sqlalchemy.orm import Session, sessionmaker

from deferral.runtime.config import Settings
from deferral.store import actions, transitions
from deferral.store.tables import DagRun, TaskInstance
from scheduler.service import SchedulerService
from tests.integration.factories import finish_queued
from tests.integration.test_scheduler import WriteDag, _scheduler, _step

DAY1 = dt.datetime(2024, 1, 1, tzinfo=dt.UTC)
DAY2 = dt.datetime(2024, 1, 2, tzinfo=dt.UTC)


@pytest.fixture
def dag_id() -> str:
    return f"past_{uuid.uuid4().hex[:8]}"


def _write(write_dag: WriteDag, dag_id: str, tasks: str, default_args: str = "{}") -> None:
    # Written as Airflow's tutorial writes it: the flags in default_args, pendulum dates.
    write_dag(
        dag_id,
        f"""
import pendulum
from deferral import DAG
from deferral.operators.empty import EmptyOperator

with DAG(
    "{dag_id}",
    start_date=pendulum.datetime(2023, 12, 1, tz="UTC"),
    schedule=None,
    default_args={default_args},
) as dag:
{tasks}
""",
    )


def _trigger(sessions: sessionmaker[Session], dag_id: str, run_id: str, when: dt.datetime) -> None:
    with sessions.begin() as session:
        transitions.create_dag_run(session, dag_id, run_id, when, {})


def _state(sessions: sessionmaker[Session], run_id: str, task_id: str) -> str:
    with sessions() as session:
        return session.scalars(
            select(TaskInstance.state).where(
                TaskInstance.run_id == run_id, TaskInstance.task_id == task_id
            )
        ).one()


def _finish(sessions: sessionmaker[Session], run_id: str, task_id: str, *, ok: bool = True) -> None:
    """What a worker does with the queued attempt of ``task_id`` in ``run_id``."""
    where = (TaskInstance.run_id == run_id, TaskInstance.task_id == task_id)
    finish_queued(sessions, *where, ok=ok)


def _two_runs(settings: Settings, sessions: sessionmaker[Session], dag_id: str) -> SchedulerService:
    """Runs r1 and r2 (a day later) of the DAG, started and evaluated."""
    service = _scheduler(settings)
    _trigger(sessions, dag_id, "r1", DAY1)
    _trigger(sessions, dag_id, "r2", DAY2)
    _steps(service)
    return service


def _steps(service: SchedulerService, n: int = 3) -> None:
    """Enough loops for a change in one run to reach the next: one evaluates the changed run
    and marks the next, one evaluates the next."""
    for _ in range(n):
        _step(service)


def test_a_task_waits_for_its_previous_run_and_goes_when_it_succeeds(
    settings: Settings, sessions: sessionmaker[Session], write_dag: WriteDag, dag_id: str
) -> None:
    _write(
        write_dag,
        dag_id,
        '    EmptyOperator(task_id="a") >> EmptyOperator(task_id="b")',
        '{"depends_on_past": True}',
    )
    service = _two_runs(settings, sessions, dag_id)
    assert _state(sessions, "r1", "a") == "queued"  # the first run has no previous run
    assert _state(sessions, "r2", "a") == "none"
    _finish(sessions, "r1", "a")
    _steps(service)
    # r1's b is still to run, but r2's a only waits on r1's a.
    assert _state(sessions, "r2", "a") == "queued"
    assert _state(sessions, "r2", "b") == "none"
    _finish(sessions, "r2", "a")
    _steps(service)
    assert _state(sessions, "r2", "b") == "none"  # r1's b is not done yet
    _finish(sessions, "r1", "b")
    _steps(service)
    assert _state(sessions, "r2", "b") == "queued"


def test_a_failed_previous_task_holds_the_next_run_until_it_is_marked_success(
    settings: Settings, sessions: sessionmaker[Session], write_dag: WriteDag, dag_id: str
) -> None:
    _write(write_dag, dag_id, '    EmptyOperator(task_id="a", depends_on_past=True)')
    service = _two_runs(settings, sessions, dag_id)
    _finish(sessions, "r1", "a", ok=False)
    _steps(service, 5)
    assert _state(sessions, "r2", "a") == "none"
    with sessions() as session:
        assert session.scalars(select(DagRun.state).where(DagRun.run_id == "r1")).one() == "failed"
    # What `deferral tasks mark ... success` and the web UI do: r1 reopens, and its look
    # lets r2 go.
    dag = service.dagbag.dags[dag_id]
    actions.change_tasks(sessions, dag, "r1", "a", actions.mark_change("success"))
    _steps(service)
    assert _state(sessions, "r2", "a") == "queued"


def test_wait_for_downstream_waits_for_the_previous_runs_downstream_tasks(
    settings: Settings, sessions: sessionmaker[Session], write_dag: WriteDag, dag_id: str
) -> None:
    _write(
        write_dag,
        dag_id,
        '    EmptyOperator(task_id="a", wait_for_downstream=True) >> EmptyOperator(task_id="b")',
    )
    service = _two_runs(settings, sessions, dag_id)
    _finish(sessions, "r1", "a")
    _steps(service)
    assert _state(sessions, "r1", "b") == "queued"
    assert _state(sessions, "r2", "a") == "none"
    _finish(sessions, "r1", "b")
    _steps(service)
    assert _state(sessions, "r2", "a") == "queued"


@pytest.mark.parametrize(("ignore_first", "expected"), [(True, "queued"), (False, "none")])
def test_a_previous_run_without_the_task_holds_it_unless_ignore_first_depends_on_past(
    settings: Settings,
    sessions: sessionmaker[Session],
    write_dag: WriteDag,
    dag_id: str,
    ignore_first: bool,
    expected: str,
) -> None:
    _write(
        write_dag,
        dag_id,
        '    EmptyOperator(task_id="old")\n    EmptyOperator(task_id="a")',
        f'{{"depends_on_past": True, "ignore_first_depends_on_past": {ignore_first}}}',
    )
    service = _scheduler(settings)
    _trigger(sessions, dag_id, "r1", DAY1)
    _steps(service)
    # r1 ran before "a" was in the DAG: it has no task instance of it.
    with sessions.begin() as session:
        session.execute(
            delete(TaskInstance).where(TaskInstance.run_id == "r1", TaskInstance.task_id == "a")
        )
    _trigger(sessions, dag_id, "r2", DAY2)
    _steps(service)
    assert _state(sessions, "r2", "a") == expected


def test_a_held_task_is_still_skipped_by_its_trigger_rule_unless_it_waits_for_the_past(
    settings: Settings, sessions: sessionmaker[Session], write_dag: WriteDag, dag_id: str
) -> None:
    _write(
        write_dag,
        dag_id,
        '    up = EmptyOperator(task_id="up")\n'
        '    up >> EmptyOperator(task_id="a", depends_on_past=True)\n'
        '    up >> EmptyOperator(task_id="patient", depends_on_past=True,'
        " wait_for_past_depends_before_skipping=True)",
    )
    service = _two_runs(settings, sessions, dag_id)
    where = (TaskInstance.run_id == "r2", TaskInstance.task_id == "up")
    finish_queued(sessions, *where, skip=True)
    _steps(service)
    assert _state(sessions, "r2", "a") == "skipped"
    assert _state(sessions, "r2", "patient") == "none"


def test_with_catchup_the_previous_run_is_the_previous_scheduled_one(
    settings: Settings, sessions: sessionmaker[Session], write_dag: WriteDag, dag_id: str
) -> None:
    """As Airflow 2.10: with catchup, a manual run between two scheduled runs is not the one
    a scheduled run's depends_on_past task waits on."""
    write_dag(
        dag_id,
        f"""
import pendulum
from deferral import DAG
from deferral.operators.empty import EmptyOperator

with DAG("{dag_id}", start_date=pendulum.datetime(2023, 12, 1, tz="UTC"), schedule="@daily",
         catchup=True):
    EmptyOperator(task_id="a", depends_on_past=True)
""",
    )
    service = _scheduler(settings)
    with sessions.begin() as session:
        for run_id, when, run_type in [
            ("r1", DAY1, "scheduled"),
            ("m", DAY1 + dt.timedelta(hours=12), "manual"),
            ("r2", DAY2, "scheduled"),
        ]:
            transitions.create_dag_run(session, dag_id, run_id, when, {}, run_type=run_type)
    _steps(service)
    assert _state(sessions, "m", "a") == "none"  # its previous scheduled run is r1
    _finish(sessions, "r1", "a")
    _steps(service)
    assert _state(sessions, "m", "a") == "queued"
    assert _state(sessions, "r2", "a") == "queued"
