"""Assets against real PostgreSQL: a task's outlets record an asset event with its success,
each event makes one run of the DAG scheduled on the asset (with its triggering_asset_events),
``a & b`` waits for both, a watcher's event is recorded once per key, and watchers run only
while their DAG is active."""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path
from typing import Any

import anyio
import pytest
from click.testing import CliRunner
from sqlalchemy import func, select, update
from sqlalchemy.orm import Session, sessionmaker

from deferral.assets import Asset, AssetAlias
from deferral.loading.dagbag import DagBag
from deferral.runtime.config import Settings
from deferral.runtime.crypto import Cipher
from deferral.store import retention, transitions
from deferral.store.asset_events import LazyInletEvents, triggering_events
from deferral.store.tables import AssetEventRow, AssetWatcherRow, Dag, DagRun
from deferral.store.transitions import Attempt
from deferral.store.transitions.asset_events import record_watcher_event
from deferral_cli import main as deferral_main
from scheduler import assets, dagruns, dags
from tests.integration.factories import DAG_ID, WORKER, running_task
from triggerer.watchers import WatcherRunner
from worker import record
from worker.outcomes import Succeeded

NOW = dt.datetime(2024, 1, 10, 12, tzinfo=dt.UTC)

PRODUCER_AND_CONSUMERS = f"""
import datetime as dt

from deferral import DAG
from deferral.assets import Asset, AssetAlias
from deferral.operators import EmptyOperator

orders, a, b = Asset("orders"), Asset("s3://bucket/a"), Asset(name="b", uri="file:///b")

with DAG({DAG_ID!r}):
    EmptyOperator(task_id="t", outlets=[orders])

with DAG("consumer", schedule=[orders], max_active_runs=50):
    EmptyOperator(task_id="c")

with DAG("both", schedule=a & b):
    EmptyOperator(task_id="c")

with DAG("either", schedule=a | b, max_active_runs=50):
    EmptyOperator(task_id="c")

from deferral.assets import AssetAlias

with DAG("on_alias", schedule=[AssetAlias("found")], max_active_runs=50):
    EmptyOperator(task_id="c")

from deferral.timetables.assets import AssetOrTimeSchedule
from deferral.timetables.trigger import CronTriggerTimetable

weekly = CronTriggerTimetable("0 1 * * 3", timezone="UTC")
with DAG(
    "a_or_weekly",
    schedule=AssetOrTimeSchedule(timetable=weekly, assets=[a]),
    start_date=dt.datetime(2024, 1, 1, tzinfo=dt.UTC),
):
    EmptyOperator(task_id="c")
"""


def parse(sessions: sessionmaker[Session], settings: Settings, cipher: Cipher) -> DagBag:
    bag = DagBag(settings.dags_folder).collect()
    with sessions.begin() as session:
        dagruns.sync_dags(session, bag, NOW)
        dags.sync(session, bag)
        assets.sync_assets(session, bag.dags, cipher)
    return bag


def make_runs(sessions: sessionmaker[Session], bag: DagBag) -> None:
    with sessions.begin() as session:
        assets.create_runs(session, bag.dags, dt.datetime.now(dt.UTC))


def runs_of(sessions: sessionmaker[Session], dag_id: str) -> list[DagRun]:
    with sessions() as session:
        return list(
            session.scalars(select(DagRun).where(DagRun.dag_id == dag_id).order_by(DagRun.id))
        )


@pytest.fixture
def bag(
    sessions: sessionmaker[Session],
    settings: Settings,
    cipher: Cipher,
    write_dag: Any,
) -> DagBag:
    write_dag("asset_dags", PRODUCER_AND_CONSUMERS)
    return parse(sessions, settings, cipher)


def succeed(sessions: sessionmaker[Session], run_id: str) -> None:
    ti = running_task(sessions, "t", run_id)
    with sessions.begin() as session:
        assert transitions.succeed(session, Attempt(ti, 1, WORKER), None)


def test_a_producer_task_with_an_outlet_triggers_the_consumer_once_per_event(
    sessions: sessionmaker[Session], bag: DagBag
) -> None:
    succeed(sessions, "r1")
    succeed(sessions, "r2")
    make_runs(sessions, bag)
    make_runs(sessions, bag)  # nothing left to consume
    runs = runs_of(sessions, "consumer")
    assert [r.run_type for r in runs] == ["asset_triggered"] * 2
    with sessions() as session:
        sources = [
            [e.source_run_id for e in triggering_events(session, "consumer", r.run_id)["orders"]]
            for r in runs
        ]
    assert sources == [["r1"], ["r2"]]
    assert [r.dag_id for r in runs_of(sessions, "both")] == []


def test_the_extras_a_task_gave_its_outlet_events_are_recorded_with_its_success(
    sessions: sessionmaker[Session], bag: DagBag, cipher: Cipher
) -> None:
    succeed(sessions, "r1")  # no extras: the event's extra stays empty
    ti = running_task(sessions, "t", "r2")
    annotated = Succeeded(None, (), {"orders": {"rows": 3}})
    with sessions.begin() as session:
        assert record.succeed_all(session, cipher, [(Attempt(ti, 1, WORKER), annotated)]) == {ti}
    with sessions() as session:
        extras = session.execute(
            select(AssetEventRow.source_run_id, AssetEventRow.extra)
            .where(AssetEventRow.asset_name == "orders")
            .order_by(AssetEventRow.id)
        ).all()
    assert [tuple(row) for row in extras] == [("r1", {}), ("r2", {"rows": 3})]
    make_runs(sessions, bag)  # the consumer sees it in triggering_asset_events
    second = runs_of(sessions, "consumer")[-1]
    with sessions() as session:
        (event,) = triggering_events(session, "consumer", second.run_id)["orders"]
    assert event.extra == {"rows": 3}
    # A task with the asset in its inlets reads its events, oldest first.
    inlet_events = LazyInletEvents([Asset("orders")])
    assert [e.extra for e in inlet_events[Asset("orders")]] == [{}, {"rows": 3}]
    assert inlet_events.for_asset(uri="orders")[-1].source_run_id == "r2"
    with pytest.raises(KeyError, match="'other' is not an inlet of this task"):
        inlet_events["other"]


def test_events_added_through_an_alias_resolve_it_and_run_the_dags_scheduled_on_it(
    sessions: sessionmaker[Session], bag: DagBag, cipher: Cipher
) -> None:
    make_runs(sessions, bag)
    assert runs_of(sessions, "on_alias") == []  # unresolved: nothing to run on
    ti = running_task(sessions, "t", "r1")
    added = [
        {
            "alias": "found",
            "name": "s3://bucket/a",
            "uri": "s3://bucket/a",
            "group": "asset",
            "extra": {"k": 1},
        },
        {"alias": "found", "name": "new", "uri": "file:///new", "group": "asset", "extra": {}},
    ]
    with sessions.begin() as session:
        assert record.succeed_all(
            session, cipher, [(Attempt(ti, 1, WORKER), Succeeded(None, (), {}, added))]
        ) == {ti}
    make_runs(sessions, bag)
    # Each added event runs the alias's DAG, and "a"'s also runs the DAGs scheduled on "a".
    assert len(runs_of(sessions, "on_alias")) == 2
    assert len(runs_of(sessions, "either")) == 1
    inlet_events = LazyInletEvents([AssetAlias("found")])
    got = [(e.asset.name, e.asset.uri, e.extra) for e in inlet_events[AssetAlias("found")]]
    assert got == [("s3://bucket/a", "s3://bucket/a", {"k": 1}), ("new", "file:///new", {})]
    # Resolved, the alias's DAG runs on its assets' other events too (as Airflow's, re-parsed).
    with sessions.begin() as session:
        record_watcher_event(session, "new", "w", "key-1", {})
    make_runs(sessions, bag)
    assert len(runs_of(sessions, "on_alias")) == 3
    # Pruned (with the task's own "orders" event), an event takes its link to the alias with
    # it; "a"'s still waits for "both".
    with sessions.begin() as session:
        session.execute(update(AssetEventRow).values(timestamp=NOW))
    pruned = retention.prune(sessions, dt.timedelta(days=1))
    assert (pruned.asset_event, pruned.asset_alias_event) == (3, 1)
    assert [e.asset.name for e in LazyInletEvents([AssetAlias("found")])[AssetAlias("found")]] == [
        "s3://bucket/a"
    ]


def test_a_dag_scheduled_on_a_and_b_runs_only_once_both_were_updated(
    sessions: sessionmaker[Session], bag: DagBag
) -> None:
    with sessions.begin() as session:
        record_watcher_event(session, "s3://bucket/a", "test", "a1", {})
    make_runs(sessions, bag)
    assert runs_of(sessions, "both") == []
    assert len(runs_of(sessions, "either")) == 1
    with sessions.begin() as session:
        record_watcher_event(session, "s3://bucket/a", "test", "a2", {})
        record_watcher_event(session, "b", "test", "b1", {"n": 1})
    make_runs(sessions, bag)
    (run,) = runs_of(sessions, "both")
    with sessions() as session:
        events = triggering_events(session, "both", run.run_id)
    assert sorted(events) == ["b", "s3://bucket/a"]
    assert [e.extra for e in events["b"]] == [{"n": 1}]
    assert len(runs_of(sessions, "either")) == 2  # a2 and b1 together: one run
    make_runs(sessions, bag)  # a's second event waits for another b
    assert len(runs_of(sessions, "both")) == 1
    with sessions() as session:  # the schedule the web UI and `dags list` show
        shown = session.scalar(select(Dag.schedule).where(Dag.dag_id == "both"))
    assert shown == "s3://bucket/a & b"


def test_an_asset_or_time_schedule_runs_on_its_asset_and_by_the_clock(
    sessions: sessionmaker[Session], bag: DagBag
) -> None:
    with sessions.begin() as session:
        record_watcher_event(session, "s3://bucket/a", "test", "a1", {})
    make_runs(sessions, bag)
    assert [r.run_type for r in runs_of(sessions, "a_or_weekly")] == ["asset_triggered"]
    with sessions() as session:
        row = session.scalars(select(Dag).where(Dag.dag_id == "a_or_weekly")).one()
    assert row.schedule == "s3://bucket/a or 0 1 * * 3"
    # The clock's next run: the latest Wednesday 01:00 before NOW (no catchup).
    assert row.next_dagrun == dt.datetime(2024, 1, 10, 1, tzinfo=dt.UTC)


def test_a_watcher_event_is_recorded_once_per_key_and_an_oversized_extra_is_noted(
    sessions: sessionmaker[Session], bag: DagBag
) -> None:
    with sessions.begin() as session:
        first = record_watcher_event(session, "b", "w", "k", {})
        again = record_watcher_event(session, "b", "w", "k", {})
        big = record_watcher_event(session, "b", "w", "big", {"x": "y" * 100_000})
    assert first is not None and again is None and big is not None
    with sessions() as session:
        extra = session.scalar(select(AssetEventRow.extra).where(AssetEventRow.id == big))
    assert extra is not None and "over" in extra["error"]
    make_runs(sessions, bag)
    assert len(runs_of(sessions, "either")) == 2


WATCHED = """
from deferral import DAG
from deferral.assets import Asset, AssetWatcher
from deferral.operators import EmptyOperator
from deferral.triggers.event import DirectoryWatchTrigger

files = DirectoryWatchTrigger({folder!r}, "*.csv", 0.05)
watched = Asset("landing", watchers=[AssetWatcher("files", files)])

with DAG("on_files", schedule=[watched], max_active_runs=50):
    EmptyOperator(task_id="c")
"""


def test_a_watcher_runs_while_its_dag_is_active_and_records_each_new_file_once(
    sessions: sessionmaker[Session],
    settings: Settings,
    cipher: Cipher,
    write_dag: Any,
    tmp_path: Path,
) -> None:
    folder = tmp_path / "landing"
    folder.mkdir()
    (folder / "one.csv").write_text("1")
    (folder / "skip.txt").write_text("x")
    write_dag("watched", WATCHED.format(folder=str(folder)))
    bag = parse(sessions, settings, cipher)
    runner = WatcherRunner(sessions, cipher, "t1", ["deferral.triggers"], 0.05)

    def count() -> int:
        with sessions() as session:
            return int(session.scalar(select(func.count()).select_from(AssetEventRow)) or 0)

    async def main() -> None:
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(runner.run)
            with anyio.fail_after(30):
                while count() < 1:
                    await anyio.sleep(0.05)
                (folder / "two.csv").write_text("2")
                while count() < 2:
                    await anyio.sleep(0.05)
                with sessions.begin() as session:
                    session.execute(update(Dag).values(is_paused=True))
                while runner.running:
                    await anyio.sleep(0.05)
            tasks.cancel_scope.cancel()

    anyio.run(main)
    make_runs(sessions, bag)  # paused: the events wait
    assert runs_of(sessions, "on_files") == []
    with sessions.begin() as session:
        session.execute(update(Dag).values(is_paused=False))
        holder = session.scalar(select(AssetWatcherRow.triggerer_id))
    assert holder is None  # released on the way out
    make_runs(sessions, bag)
    assert count() == 2 and len(runs_of(sessions, "on_files")) == 2


def test_assets_list_shows_consumers_producers_and_recent_events(
    sessions: sessionmaker[Session], bag: DagBag, settings: Settings
) -> None:
    succeed(sessions, "r1")
    listed = CliRunner().invoke(deferral_main, ["assets", "list", "--json"])
    assert listed.exit_code == 0, listed.output
    orders = {r["name"]: r for r in json.loads(listed.output)}["orders"]
    assert orders["scheduled_dags"] == ["consumer"]
    assert orders["producing_tasks"] == [f"{DAG_ID}.t"]
    assert orders["queued_events"] == 1
    assert [e.split()[-1] for e in orders["recent_events"]] == [f"{DAG_ID}.r1.t"]
    refused = CliRunner().invoke(deferral_main, ["assets", "list", "--events", "1000"])
    assert refused.exit_code == 2 and "--events" in refused.output


def test_prune_drops_old_asset_events_no_dag_waits_for(
    sessions: sessionmaker[Session], bag: DagBag
) -> None:
    with sessions.begin() as session:
        record_watcher_event(session, "orders", "w", "consumed", {})
    make_runs(sessions, bag)  # "consumer" consumed it
    with sessions.begin() as session:
        record_watcher_event(session, "orders", "w", "queued", {})
        session.execute(update(AssetEventRow).values(timestamp=NOW))
    pruned = retention.prune(sessions, dt.timedelta(days=1))
    assert pruned.asset_event == 1
    with sessions() as session:
        left = session.scalars(select(AssetEventRow.dedup_key)).all()
    assert left == ["queued"]  # "consumer" still waits for it
