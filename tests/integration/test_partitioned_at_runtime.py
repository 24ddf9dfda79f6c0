"""A ``PartitionedAtRuntime`` DAG against real PostgreSQL, as Airflow runs one: no run by the
clock; a run triggered with a partition key (the CLI, as a user would) gives that key to its
outlet events, the keys its task adds at run time (`deferral dags test`, the task's own code)
make an event each, and the ``PartitionedAssetTimetable`` DAG on the asset gets one run per
key. A key for a DAG that is not partitioned is refused naming the DAG."""

from __future__ import annotations

import os
import subprocess
from typing import Any

import pytest
from cryptography.fernet import Fernet
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from deferral.assets import OutletEventAccessors
from deferral.loading.dagbag import DagBag
from deferral.runtime.config import Settings
from deferral.runtime.crypto import Cipher
from deferral.store import transitions
from deferral.store.tables import AssetEventRow, DagRun, TaskInstance
from deferral.store.transitions import Attempt
from deferral.store.transitions.runs import NewTaskInstance
from tests.forks import LANE
from tests.integration.conftest import web_client
from tests.integration.factories import WORKER
from tests.integration.test_api_tokens import _bearer, _make
from tests.integration.test_assets import make_runs, parse, runs_of
from tests.parsed_dags import record_dags_folder
from worker import record
from worker.outcomes import Succeeded

TIMEOUT_SEC = 180

# As Airflow's docs write it, imports from airflow.sdk included.
DAGS = """
import pendulum
from airflow.sdk import DAG, Asset, PartitionedAssetTimetable, PartitionedAtRuntime, task

positions = Asset(name="acct_positions", uri="s3://bucket/positions")

with DAG("load_positions", schedule=PartitionedAtRuntime(),
         start_date=pendulum.datetime(2024, 1, 1, tz="UTC")):

    @task(outlets=[positions])
    def load(*, outlet_events=None, dag_run=None):
        if dag_run.partition_key is None:
            outlet_events[positions].add_partitions(["ACCT1", "ACCT2", "ACCT1"])

    load()

with DAG("risk_per_account", schedule=PartitionedAssetTimetable(assets=positions),
         max_active_runs=50):

    @task
    def compute(dag_run=None):
        return dag_run.partition_key

    compute()

with DAG("plain", schedule=None, start_date=pendulum.datetime(2024, 1, 1, tz="UTC")):

    @task
    def nothing():
        pass

    nothing()
"""

_NO_WAITER_CIPHER = Cipher([Fernet.generate_key().decode()])


@pytest.fixture(autouse=True)
def airflow_imports(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DEFERRAL_AIRFLOW_IMPORTS", "true")


def parsed_bag(sessions: sessionmaker[Session], settings: Settings, cipher: Cipher) -> DagBag:
    """The DAGs folder parsed, synced and recorded as a scheduler does (the CLI reads the
    documents), loading without import errors."""
    found = parse(sessions, settings, cipher)
    assert found.import_errors == {}
    record_dags_folder(settings)
    return found


@pytest.fixture
def bag(
    sessions: sessionmaker[Session], settings: Settings, cipher: Cipher, write_dag: Any
) -> DagBag:
    write_dag("runtime_partitions", DAGS)
    return parsed_bag(sessions, settings, cipher)


def _cli(service_env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, **service_env, "DEFERRAL_AIRFLOW_IMPORTS": "true"}
    return LANE.run(list(args), env, TIMEOUT_SEC)


def _succeed_in(sessions: sessionmaker[Session], bag: DagBag, run: DagRun) -> None:
    """What the worker records when ``load`` succeeds in ``run``: its outlet events, by
    ``OutletEventAccessors.partitions`` of the run's key (the task adds none in a keyed run)."""
    outlets = bag.dags["load_positions"].get_task("load").outlets
    success = Succeeded(
        None, outlet_partitions=OutletEventAccessors(outlets).partitions(run.partition_key)
    )
    with sessions.begin() as session:
        row = session.get(DagRun, run.id)
        assert row is not None
        transitions.start_dag_run(
            session, row, [NewTaskInstance("load", 0, "default_pool", 1, "default", 1)]
        )
        session.flush()
        ti = session.scalars(
            select(TaskInstance.id).where(
                TaskInstance.dag_id == row.dag_id, TaskInstance.run_id == row.run_id
            )
        ).one()
        transitions.schedule(session, [ti])
        transitions.dispatch(session, [ti])
        assert transitions.start_many(session, [(ti, 1)], "host", WORKER)
        assert record.succeed_all(
            session, _NO_WAITER_CIPHER, [(Attempt(ti, 1, WORKER), success)]
        ) == {ti}


def _keys(sessions: sessionmaker[Session], dag_id: str) -> list[str | None]:
    return sorted(run.partition_key or "" for run in runs_of(sessions, dag_id))


def test_a_run_triggered_with_a_key_makes_the_downstream_run_of_that_key(
    sessions: sessionmaker[Session], bag: DagBag, service_env: dict[str, str]
) -> None:
    done = _cli(service_env, "dags", "trigger", "load_positions", "--partition-key", "ACCT9")
    assert done.returncode == 0, done.stdout + done.stderr
    (run,) = runs_of(sessions, "load_positions")
    assert (run.partition_key, run.run_type) == ("ACCT9", "manual")
    _succeed_in(sessions, bag, run)
    with sessions() as session:
        assert session.scalars(select(AssetEventRow.partition_key)).all() == ["ACCT9"]
    make_runs(sessions, bag)
    assert _keys(sessions, "risk_per_account") == ["ACCT9"]


def test_keys_the_task_adds_at_run_time_make_one_downstream_run_each(
    sessions: sessionmaker[Session], bag: DagBag, service_env: dict[str, str]
) -> None:
    # The task's own code, in a task process: it adds ACCT1 twice, which is one event.
    done = _cli(service_env, "dags", "test", "load_positions")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    with sessions() as session:
        keys = session.scalars(select(AssetEventRow.partition_key)).all()
    assert sorted(keys) == ["ACCT1", "ACCT2"]
    make_runs(sessions, bag)
    assert _keys(sessions, "risk_per_account") == ["ACCT1", "ACCT2"]
    # The clock never runs it: no run but the test's.
    assert len(runs_of(sessions, "load_positions")) == 1


def test_a_key_for_a_dag_that_is_not_partitioned_is_refused_naming_it(
    sessions: sessionmaker[Session], bag: DagBag, service_env: dict[str, str]
) -> None:
    done = _cli(service_env, "dags", "trigger", "plain", "--partition-key", "k")
    assert done.returncode != 0
    assert done.stderr.strip().splitlines()[-1] == (
        "error: DAG 'plain' is not partitioned: a partition key needs a CronPartitionTimetable,"
        " PartitionedAssetTimetable or PartitionedAtRuntime schedule"
    )
    assert runs_of(sessions, "plain") == []


def test_the_api_triggers_with_a_partition_key_and_refuses_a_bad_one(
    settings: Settings, sessions: sessionmaker[Session], bag: DagBag
) -> None:
    token = _make("bot", "runs")
    with web_client(settings, "0.0.0.0") as client:
        made = client.post(
            "/api/v1/dags/load_positions/runs",
            json={"partition_key": "ACCT7"},
            headers=_bearer(token),
        )
        assert made.status_code == 201, made.text
        for dag_id, key, error in (
            ("load_positions", 7, "partition_key must be a string"),
            ("load_positions", " ", "DAG 'load_positions': a partition key is a non-blank"),
            ("plain", "k", "DAG 'plain' is not partitioned"),
        ):
            refused = client.post(
                f"/api/v1/dags/{dag_id}/runs", json={"partition_key": key}, headers=_bearer(token)
            )
            assert refused.status_code == 400, refused.text
            assert refused.json()["error"].startswith(error)
    assert _keys(sessions, "load_positions") == ["ACCT7"]
    assert runs_of(sessions, "plain") == []
