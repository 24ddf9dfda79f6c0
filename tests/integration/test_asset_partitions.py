"""Partition-aligned asset runs against real PostgreSQL: a task in a run with a partition key
records its outlet events with that key (or one event per key it added), and the scheduler's
asset pass makes one run per mapped key of a DAG scheduled with ``PartitionedAssetTimetable``,
once its assets' events for that key are there (a rollup's, by its window), and once per set
of events; Airflow 3.3's example_asset_partition.py aligns three producers' hours unchanged."""

from __future__ import annotations

import datetime as dt
import logging
import shutil
from pathlib import Path
from typing import Any

import pytest
from cryptography.fernet import Fernet
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from deferral.assets import Asset, OutletEventAccessors
from deferral.context import DagRunInfo, with_partition
from deferral.loading.dagbag import DagBag
from deferral.partitions import PartitionError
from deferral.runtime.config import Settings
from deferral.runtime.crypto import Cipher
from deferral.store import transitions
from deferral.store.tables import (
    AssetDagRunQueue,
    AssetEventRow,
    DagRun,
    DagRunAssetEvent,
    TaskInstance,
)
from deferral.store.transitions import Attempt
from deferral.store.transitions import assets as asset_runs
from deferral.store.transitions.runs import NewTaskInstance
from deferral.timetables.partitions import CronPartitionTimetable
from tests.integration.factories import DAG_ID, WORKER, running_task
from tests.integration.test_assets import make_runs, parse, runs_of
from worker import record
from worker.outcomes import Succeeded

EXAMPLES = Path(__file__).resolve().parents[1] / "airflow_examples"

PARTITIONED_DAGS = f"""
import datetime as dt

from deferral import DAG
from deferral.assets import Asset
from deferral.operators import EmptyOperator
from deferral.partitions import (
    AllowedKeyMapper, FixedKeyMapper, RollupMapper, SegmentWindow, StartOfMonthMapper
)
from deferral.timetables.partitions import CronPartitionTimetable, PartitionedAssetTimetable

daily, other, regions = Asset("daily"), Asset("other"), Asset("regions")

with DAG(
    {DAG_ID!r},
    schedule=CronPartitionTimetable("0 0 * * *", timezone="UTC", key_format="%Y-%m-%d"),
    start_date=dt.datetime(2024, 5, 1, tzinfo=dt.UTC),
):
    EmptyOperator(task_id="t", outlets=[daily, other, regions])
    EmptyOperator(task_id="daily_only", outlets=[daily])

with DAG("per_day", schedule=PartitionedAssetTimetable(assets=daily), max_active_runs=50):
    EmptyOperator(task_id="c")

with DAG(
    "per_month",
    schedule=PartitionedAssetTimetable(
        assets=daily, default_partition_mapper=StartOfMonthMapper(input_format="%Y-%m-%d")
    ),
    max_active_runs=50,
):
    EmptyOperator(task_id="c")

with DAG(
    "both",
    schedule=PartitionedAssetTimetable(assets=daily & other),
    max_active_runs=50,
):
    EmptyOperator(task_id="c")

with DAG(
    "per_region",
    schedule=PartitionedAssetTimetable(
        assets=regions,
        partition_mapper_config={{regions: AllowedKeyMapper(["eu", "us", "ap"])}},
    ),
    max_active_runs=50,
):
    EmptyOperator(task_id="c")

with DAG(
    "all_regions",
    schedule=PartitionedAssetTimetable(
        assets=regions,
        default_partition_mapper=RollupMapper(
            upstream_mapper=FixedKeyMapper("all"), window=SegmentWindow(["eu", "us"])
        ),
    ),
):
    EmptyOperator(task_id="c")
"""


@pytest.fixture
def bag(
    sessions: sessionmaker[Session], settings: Settings, cipher: Cipher, write_dag: Any
) -> DagBag:
    write_dag("partitioned_dags", PARTITIONED_DAGS)
    return parse(sessions, settings, cipher)


# No task waits on these assets' events here: the key seals no payload.
_NO_WAITER_CIPHER = Cipher([Fernet.generate_key().decode()])


def produce(
    sessions: sessionmaker[Session],
    bag: DagBag,
    run_id: str,
    added: dict[str, list[str]] | None = None,
    task_id: str = "t",
    dag_id: str = DAG_ID,
    logical_date: dt.datetime = dt.datetime(2024, 5, 6, tzinfo=dt.UTC),
) -> None:
    """The task ``task_id`` succeeds in a run of its DAG's CronPartitionTimetable at
    ``logical_date`` (the producer's key ``2024-05-06``), having added the partition keys
    ``added`` to some of its outlets."""
    timetable = bag.dags[dag_id].timetable
    assert isinstance(timetable, CronPartitionTimetable)
    run = with_partition(DagRunInfo(dag_id, run_id, logical_date), timetable)
    events = OutletEventAccessors(bag.dags[dag_id].get_task(task_id).outlets)
    for name, keys in (added or {}).items():
        events[name].add_partitions(keys)
    ti = running_task(sessions, task_id, run_id, dag_id)
    success = Succeeded(None, outlet_partitions=events.partitions(run.partition_key))
    with sessions.begin() as session:
        assert record.succeed_all(
            session, _NO_WAITER_CIPHER, [(Attempt(ti, 1, WORKER), success)]
        ) == {ti}


def keys_of(sessions: sessionmaker[Session], dag_id: str) -> list[str | None]:
    return [run.partition_key for run in runs_of(sessions, dag_id)]


def test_a_run_with_a_partition_key_makes_one_run_per_mapped_key_once(
    sessions: sessionmaker[Session], bag: DagBag
) -> None:
    produce(sessions, bag, "r1")
    with sessions() as session:
        recorded = session.execute(
            select(AssetEventRow.asset_name, AssetEventRow.partition_key).order_by(AssetEventRow.id)
        ).all()
    # Every outlet of the task records its event with the run's key (the task declares three).
    assert [tuple(r) for r in recorded] == [
        ("daily", "2024-05-06"),
        ("other", "2024-05-06"),
        ("regions", "2024-05-06"),
    ]
    make_runs(sessions, bag)
    make_runs(sessions, bag)  # a second pass makes nothing more
    assert keys_of(sessions, "per_day") == ["2024-05-06"]
    assert keys_of(sessions, "per_month") == ["2024-05"]
    assert keys_of(sessions, "both") == ["2024-05-06"]  # daily & other, the same key
    assert keys_of(sessions, "per_region") == []  # not an allowed key: consumed, no run
    (run,) = runs_of(sessions, "per_day")
    assert run.run_type == "asset_triggered"
    # Its tasks' attempts carry the key to their context["partition_key"].
    with sessions.begin() as session:
        row = session.get_one(DagRun, run.id)
        transitions.start_dag_run(
            session, row, [NewTaskInstance("c", 0, "default_pool", 1, "default", 1)]
        )
        session.flush()
        ti_id = session.scalars(select(TaskInstance.id).where(TaskInstance.run_id == run.run_id))
        started = transitions.preview_start(session, ti_id.one())
    assert started is not None
    assert record.request_of(started, None, 1000).partition_key == "2024-05-06"
    assert DagRunInfo.of(run).partition_key == "2024-05-06"
    # The key's events again (its partition made anew): a run each of the DAGs on "daily" alone,
    # and "both" waits for "other"'s (as Airflow's, whose key's run was made already).
    produce(sessions, bag, "r2", task_id="daily_only")
    make_runs(sessions, bag)
    assert keys_of(sessions, "per_day") == ["2024-05-06", "2024-05-06"]
    assert keys_of(sessions, "per_month") == ["2024-05", "2024-05"]
    assert keys_of(sessions, "both") == ["2024-05-06"]
    with sessions() as session:
        assert session.scalars(select(AssetDagRunQueue.target_dag_id)).all() == ["both"]


def test_added_partitions_make_one_event_and_run_each_and_a_bad_key_is_named(
    sessions: sessionmaker[Session], bag: DagBag, caplog: pytest.LogCaptureFixture
) -> None:
    produce(sessions, bag, "r1", {"regions": ["eu", "us", "ap", "xx"]})
    with caplog.at_level(logging.WARNING, logger="deferral.scheduler"):
        make_runs(sessions, bag)
    assert sorted(keys_of(sessions, "per_region")) == ["ap", "eu", "us"]
    assert "partition key 'xx' is not one of ['eu', 'us', 'ap']" in caplog.text
    with pytest.raises(
        PartitionError,
        match=r"^add_partitions on 'regions': partition key must be a non-empty string, got ''$",
    ):
        OutletEventAccessors([Asset("regions")])["regions"].add_partitions(["eu", ""])


def test_a_pass_reads_a_bounded_number_of_queued_events(
    sessions: sessionmaker[Session], bag: DagBag, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(asset_runs, "PARTITION_EVENTS_PER_PASS", 2)
    produce(sessions, bag, "r1", {"regions": ["eu", "us", "ap"]})
    make_runs(sessions, bag)
    assert sorted(keys_of(sessions, "per_region")) == ["eu", "us"]
    make_runs(sessions, bag)
    assert sorted(keys_of(sessions, "per_region")) == ["ap", "eu", "us"]
    with sessions() as session:
        assert (
            session.scalar(
                select(DagRun.id).where(
                    DagRun.dag_id == "per_region", DagRun.partition_key.is_(None)
                )
            )
            is None
        )


def test_a_rollup_runs_once_its_window_members_are_there(
    sessions: sessionmaker[Session], bag: DagBag
) -> None:
    produce(sessions, bag, "r1", {"regions": ["eu"]})
    make_runs(sessions, bag)
    assert keys_of(sessions, "all_regions") == []  # "us" not there yet: the event waits
    produce(sessions, bag, "r2", {"regions": ["us"]})
    make_runs(sessions, bag)
    assert keys_of(sessions, "all_regions") == ["all"]
    (run,) = runs_of(sessions, "all_regions")
    with sessions() as session:
        consumed = session.scalars(
            select(AssetEventRow.partition_key)
            .join(DagRunAssetEvent, DagRunAssetEvent.asset_event_id == AssetEventRow.id)
            .where(DagRunAssetEvent.dag_run_id == run.id)
            .order_by(AssetEventRow.partition_key)
        ).all()
    assert consumed == ["eu", "us"]


def test_airflows_example_aligns_three_teams_hourly_partitions_into_one_run(
    sessions: sessionmaker[Session], settings: Settings, cipher: Cipher, dags_folder: Path
) -> None:
    """example_asset_partition.py, unchanged under the import hook: the three teams' hourly
    producers (at :00, :15 and :30) make one run of clean_and_combine_player_stats, keyed by
    the hour their keys map to (StartOfHourMapper)."""
    shutil.copy(EXAMPLES / "example_asset_partition.py", dags_folder)
    shutil.copy(EXAMPLES / ".deferral.toml", dags_folder)
    bag = parse(sessions, settings, cipher)
    hour = dt.datetime(2024, 5, 6, 10, tzinfo=dt.UTC)
    producers = [
        ("ingest_team_a_player_stats", "ingest_team_a_stats", 0),
        ("team_b_player_stats", "team_b_player_stats", 15),
        ("team_c_player_stats", "team_c_player_stats", 30),
    ]
    for n, (dag_id, task_id, minute) in enumerate(producers[:2]):
        produce(sessions, bag, f"p{n}", {}, task_id, dag_id, hour + dt.timedelta(minutes=minute))
    make_runs(sessions, bag)
    assert keys_of(sessions, "clean_and_combine_player_stats") == []  # team C's not there
    dag_id, task_id, minute = producers[2]
    produce(sessions, bag, "p2", {}, task_id, dag_id, hour + dt.timedelta(minutes=minute))
    make_runs(sessions, bag)
    make_runs(sessions, bag)
    assert keys_of(sessions, "clean_and_combine_player_stats") == ["2024-05-06T10"]
