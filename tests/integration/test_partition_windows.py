"""Windows of time through the scheduler's asset pass, against real PostgreSQL: a producer's
task adds partition keys at run time (`deferral dags test`, its own code), an ``HourWindow``
rollup makes its hour's run once the 60 minutes are there, and a fan-out over a ``WeekWindow``
makes one run per day of the week, keyed as Airflow keys them."""

from __future__ import annotations

import json
import os
from typing import Any

import pytest
from sqlalchemy.orm import Session, sessionmaker

from deferral.loading.dagbag import DagBag
from deferral.runtime.config import Settings
from deferral.runtime.crypto import Cipher
from tests.forks import LANE
from tests.integration.test_assets import make_runs, runs_of
from tests.integration.test_partitioned_at_runtime import airflow_imports, parsed_bag

TIMEOUT_SEC = 180
# The DAG file imports from airflow.sdk (its autouse fixture).
__all__ = ["airflow_imports"]

DAGS = """
import pendulum
from airflow.sdk import (
    DAG, Asset, FanOutMapper, HourWindow, PartitionedAssetTimetable, PartitionedAtRuntime,
    RollupMapper, StartOfHourMapper, StartOfWeekMapper, WeekWindow, task,
)

minutes, weeks = Asset("minutes"), Asset("weeks")

with DAG("producer", schedule=PartitionedAtRuntime(),
         start_date=pendulum.datetime(2024, 1, 1, tz="UTC")):

    @task(outlets=[minutes, weeks])
    def produce(*, outlet_events=None, dag_run=None):
        for name, asset in (("minutes", minutes), ("weeks", weeks)):
            keys = dag_run.conf.get(name)
            if keys:
                outlet_events[asset].add_partitions(keys)

    produce()

with DAG("hourly", schedule=PartitionedAssetTimetable(
        assets=minutes,
        default_partition_mapper=RollupMapper(
            upstream_mapper=StartOfHourMapper(input_format="%Y-%m-%dT%H:%M"), window=HourWindow()
        ),
)):

    @task
    def roll_up():
        pass

    roll_up()

with DAG("daily", schedule=PartitionedAssetTimetable(
        assets=weeks,
        default_partition_mapper=FanOutMapper(
            upstream_mapper=StartOfWeekMapper(input_format="%Y-%m-%d"), window=WeekWindow()
        ),
), max_active_runs=10):

    @task
    def per_day():
        pass

    per_day()
"""


@pytest.fixture
def bag(
    sessions: sessionmaker[Session], settings: Settings, cipher: Cipher, write_dag: Any
) -> DagBag:
    write_dag("windows", DAGS)
    return parsed_bag(sessions, settings, cipher)


def _produce(service_env: dict[str, str], **keys: list[str]) -> None:
    env = {**os.environ, **service_env, "DEFERRAL_AIRFLOW_IMPORTS": "true"}
    done = LANE.run(["dags", "test", "producer", "--conf", json.dumps(keys)], env, TIMEOUT_SEC)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]


def _keys(sessions: sessionmaker[Session], dag_id: str) -> list[str | None]:
    return sorted(run.partition_key or "" for run in runs_of(sessions, dag_id))


def test_an_hour_rollup_waits_for_its_sixty_minutes(
    sessions: sessionmaker[Session], bag: DagBag, service_env: dict[str, str]
) -> None:
    minutes = [f"2024-03-13T10:{m:02d}" for m in range(60)]
    _produce(service_env, minutes=[*minutes[:59], "2024-03-13T11:00"])
    make_runs(sessions, bag)
    assert _keys(sessions, "hourly") == []  # 10:59 is missing; 11:00 is another hour's
    _produce(service_env, minutes=minutes[59:])
    make_runs(sessions, bag)
    assert _keys(sessions, "hourly") == ["2024-03-13T10"]


def test_a_week_fans_out_into_a_run_per_day(
    sessions: sessionmaker[Session], bag: DagBag, service_env: dict[str, str]
) -> None:
    _produce(service_env, weeks=["2024-03-13"])
    make_runs(sessions, bag)
    assert _keys(sessions, "daily") == [f"2024-03-{d}" for d in range(11, 18)]
