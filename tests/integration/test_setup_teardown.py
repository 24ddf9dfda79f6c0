"""Setup and teardown tasks in the scheduler, against real Postgres and Redis: the teardown runs
after failed work, the run's state is the work's, and clearing the work clears its setup and
teardown (Airflow 2.10's rules)."""

from __future__ import annotations

import datetime as dt
import uuid

import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from deferral.runtime.config import Settings
from deferral.store import actions
from deferral.store.tables import DagRun, TaskInstance
from tests.integration.test_depends_on_past import _finish, _steps, _trigger
from tests.integration.test_scheduler import WriteDag, _scheduler


@pytest.fixture
def dag_id() -> str:
    return f"st_{uuid.uuid4().hex[:8]}"


def _write(write_dag: WriteDag, dag_id: str, teardown_args: str = "") -> None:
    # As Airflow's example_setup_teardown_taskflow writes it, imports from airflow included.
    write_dag(
        dag_id,
        f"""
import pendulum
from airflow.decorators import setup, task, teardown
from airflow.models.dag import DAG

with DAG("{dag_id}", start_date=pendulum.datetime(2021, 1, 1, tz="UTC"), catchup=False):

    @setup
    def create_cluster():
        return "cluster-1"

    @task
    def work(cluster):
        print(cluster)

    @task(trigger_rule="all_done")
    def report():
        print("report")

    @teardown{teardown_args}
    def delete_cluster(cluster):
        print("deleted", cluster)

    cluster = create_cluster()
    with cluster >> delete_cluster(cluster):
        work(cluster) >> report()
""",
    )


def _states(sessions: sessionmaker[Session]) -> dict[str, str]:
    with sessions() as session:
        return dict(session.execute(select(TaskInstance.task_id, TaskInstance.state)).all())


def _run_state(sessions: sessionmaker[Session]) -> str:
    with sessions() as session:
        return session.scalars(select(DagRun.state)).one()


@pytest.fixture(autouse=True)
def airflow_imports(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DEFERRAL_AIRFLOW_IMPORTS", "true")


def test_the_teardown_runs_after_failed_work_and_the_run_fails_with_the_work(
    settings: Settings, sessions: sessionmaker[Session], write_dag: WriteDag, dag_id: str
) -> None:
    _write(write_dag, dag_id)
    service = _scheduler(settings)
    assert service.dagbag.collect().import_errors == {}
    _trigger(sessions, dag_id, "r1", dt.datetime.now(dt.UTC))
    _steps(service, 1)
    assert _states(sessions) == {
        "create_cluster": "queued",
        "work": "none",
        "report": "none",
        "delete_cluster": "none",
    }
    _finish(sessions, "r1", "create_cluster")
    _steps(service, 1)
    _finish(sessions, "r1", "work", ok=False)
    _steps(service, 1)
    # report (all_done) is in the cluster's scope: its setup succeeded, so it runs.
    assert _states(sessions)["report"] == "queued"
    assert _states(sessions)["delete_cluster"] == "none"  # waits for report
    _finish(sessions, "r1", "report", ok=False)
    _steps(service, 1)
    assert _states(sessions)["delete_cluster"] == "queued"
    _finish(sessions, "r1", "delete_cluster")
    _steps(service, 1)
    # The last work task (report) failed; the teardown's success does not count.
    assert _run_state(sessions) == "failed"

    # Clearing the work clears its setup and teardown, as Airflow does.
    dag = service.dagbag.dags[dag_id]
    changed = actions.change_tasks(sessions, dag, "r1", "work", actions.clear_change)
    assert sorted(label for label, _ in changed.changed) == [
        "create_cluster",
        "delete_cluster",
        "work",
    ]
    assert _states(sessions) == {
        "create_cluster": "none",
        "work": "none",
        "report": "failed",
        "delete_cluster": "none",
    }
    _steps(service, 1)
    assert _run_state(sessions) == "running"
    assert _states(sessions)["create_cluster"] == "queued"


@pytest.mark.parametrize(
    ("teardown_args", "outcome"), [("", "success"), ("(on_failure_fail_dagrun=True)", "failed")]
)
def test_a_failed_teardown_fails_the_run_only_with_on_failure_fail_dagrun(
    settings: Settings,
    sessions: sessionmaker[Session],
    write_dag: WriteDag,
    dag_id: str,
    teardown_args: str,
    outcome: str,
) -> None:
    _write(write_dag, dag_id, teardown_args)
    service = _scheduler(settings)
    _trigger(sessions, dag_id, "r1", dt.datetime.now(dt.UTC))
    _steps(service, 1)
    for task_id in ("create_cluster", "work", "report"):
        _finish(sessions, "r1", task_id)
        _steps(service, 1)
    _finish(sessions, "r1", "delete_cluster", ok=False)
    _steps(service, 1)
    assert _states(sessions)["delete_cluster"] == "failed"
    assert _run_state(sessions) == outcome


def test_a_failed_setup_leaves_its_work_and_teardown_upstream_failed(
    settings: Settings, sessions: sessionmaker[Session], write_dag: WriteDag, dag_id: str
) -> None:
    _write(write_dag, dag_id)
    service = _scheduler(settings)
    _trigger(sessions, dag_id, "r1", dt.datetime.now(dt.UTC))
    _steps(service, 1)
    _finish(sessions, "r1", "create_cluster", ok=False)
    _steps(service, 1)
    assert _states(sessions) == {
        "create_cluster": "failed",
        "work": "upstream_failed",
        "report": "upstream_failed",  # all_done, but its setup failed
        "delete_cluster": "upstream_failed",
    }
    assert _run_state(sessions) == "failed"
