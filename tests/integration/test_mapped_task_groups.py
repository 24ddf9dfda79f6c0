"""A mapped task group over two arguments with a reducer after it, against real PostgreSQL:
map index i of a task of the group runs once map index i of its upstream in the group is done
(not all of them), the reducer waits for every map index, and `deferral dags test` runs the
Airflow 3 DAG file to the values Airflow gives."""

from __future__ import annotations

import datetime as dt
import os
import uuid
from pathlib import Path

import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from deferral.runtime.config import Settings
from deferral.store.tables import DagRun, TaskInstance, XCom
from tests.forks import LANE
from tests.integration.factories import finish_queued
from tests.integration.test_depends_on_past import _steps, _trigger
from tests.integration.test_scheduler import WriteDag, _scheduler

TIMEOUT_SEC = 180


@pytest.fixture
def dag_id() -> str:
    return f"mtg_{uuid.uuid4().hex[:8]}"


@pytest.fixture(autouse=True)
def airflow_imports(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DEFERRAL_AIRFLOW_IMPORTS", "true")


def _write(write_dag: WriteDag, dag_id: str) -> None:
    # source gives a's values, b is literal: 2 x 2 = 4 map indexes; by is shared.
    write_dag(
        dag_id,
        f"""
import pendulum
from airflow.sdk import dag, task, task_group


@dag(dag_id="{dag_id}", schedule=None, start_date=pendulum.datetime(2024, 1, 1, tz="UTC"))
def build():
    @task
    def source():
        return [1, 2]

    @task
    def add(a, b):
        return a + b

    @task
    def scale(value, by):
        return value * by

    @task_group
    def pair(a, b, by):
        return scale(add(a, b), by)

    @task(trigger_rule="all_done")
    def reduce(values):
        return list(values)

    reduce(pair.partial(by=10).expand(a=source(), b=[10, 20]))


build()
""",
    )


def _states(sessions: sessionmaker[Session], dag_id: str) -> dict[str, str]:
    with sessions() as session:
        rows = session.execute(
            select(TaskInstance.task_id, TaskInstance.map_index, TaskInstance.state).where(
                TaskInstance.dag_id == dag_id
            )
        ).all()
    return {task if index < 0 else f"{task}[{index}]": state for task, index, state in rows}


def _finish(
    sessions: sessionmaker[Session], task_id: str, map_index: int, value: object = None
) -> None:
    where = (TaskInstance.task_id == task_id, TaskInstance.map_index == map_index)
    finish_queued(sessions, *where, value=value, ok=value is not None)


def test_index_i_runs_after_its_upstream_i_and_the_reducer_after_every_index(
    settings: Settings, sessions: sessionmaker[Session], write_dag: WriteDag, dag_id: str
) -> None:
    _write(write_dag, dag_id)
    service = _scheduler(settings)
    assert service.dagbag.collect().import_errors == {}
    _trigger(sessions, dag_id, "r1", dt.datetime.now(dt.UTC))
    _steps(service, 1)
    assert _states(sessions, dag_id) == {
        "source": "queued",
        "pair.add": "none",
        "pair.scale": "none",
        "reduce": "none",
    }
    _finish(sessions, "source", -1, [1, 2])
    _steps(service, 1)
    # Both tasks of the group expanded into the 4 map indexes of a x b; only add's run.
    states = _states(sessions, dag_id)
    assert {k: v for k, v in states.items() if k.startswith("pair.add")} == {
        f"pair.add[{i}]": "queued" for i in range(4)
    }
    assert {k: v for k, v in states.items() if k.startswith("pair.scale")} == {
        f"pair.scale[{i}]": "none" for i in range(4)
    }
    _finish(sessions, "pair.add", 0, 11)
    _finish(sessions, "pair.add", 2, None)  # fails
    _steps(service, 1)
    states = _states(sessions, dag_id)
    assert (states["pair.scale[0]"], states["pair.scale[1]"]) == ("queued", "none")
    assert (states["pair.scale[2]"], states["pair.scale[3]"]) == ("upstream_failed", "none")
    assert states["reduce"] == "none"
    _finish(sessions, "pair.scale", 0, 110)
    _finish(sessions, "pair.add", 1, 21)
    _finish(sessions, "pair.add", 3, 22)
    _steps(service, 1)
    assert _states(sessions, dag_id)["reduce"] == "none"  # scale[1] and [3] are still to run
    _finish(sessions, "pair.scale", 1, 210)
    _steps(service, 1)
    assert _states(sessions, dag_id)["reduce"] == "none"
    _finish(sessions, "pair.scale", 3, 220)
    _steps(service, 1)
    assert _states(sessions, dag_id)["reduce"] == "queued"


def test_dags_test_runs_the_group_and_the_reducer_reads_every_index(
    service_env: dict[str, str],
    sessions: sessionmaker[Session],
    write_dag: WriteDag,
    dags_folder: Path,
    dag_id: str,
) -> None:
    _write(write_dag, dag_id)
    env = {**os.environ, **service_env, "DEFERRAL_DAGS_FOLDER": str(dags_folder)}
    done = LANE.run(["dags", "test", dag_id], env, TIMEOUT_SEC)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    with sessions() as session:
        assert session.scalars(select(DagRun.state).where(DagRun.dag_id == dag_id)).one() == (
            "success"
        )
        values = dict(
            session.execute(
                select(TaskInstance.task_id, XCom.value)
                .join(XCom, XCom.task_instance_id == TaskInstance.id)
                .where(TaskInstance.dag_id == dag_id, TaskInstance.task_id == "reduce")
            ).all()
        )
    # (a, b) in map-index order: (1, 10), (1, 20), (2, 10), (2, 20); each (a + b) * 10.
    assert values == {"reduce": [110, 210, 120, 220]}
