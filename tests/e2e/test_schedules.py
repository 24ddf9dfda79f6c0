"""Acceptance of schedules with real `scheduler consume` replicas and a worker: a DAG scheduled
every minute from three intervals back gets exactly those runs with catchup=True (each with its
data interval), only the latest without catchup, and max_active_runs=1 runs them one at a time."""

from __future__ import annotations

import datetime as dt
import itertools
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from deferral.store.tables import DagRun, TaskInstance
from tests.e2e.conftest import Services
from tests.helpers import wait_for

pytestmark = pytest.mark.e2e

MINUTE = dt.timedelta(minutes=1)

SOURCE = """
import datetime
import time
from deferral import DAG
from deferral.operators import PythonOperator

with DAG(
    {dag_id!r},
    schedule="*/1 * * * *",
    start_date={start!r},
    catchup={catchup},
    max_active_runs={max_active_runs},
) as dag:
    PythonOperator(task_id="work", python_callable=time.sleep, op_args=[{seconds}])
"""


def floor_minute(moment: dt.datetime) -> dt.datetime:
    return moment.replace(second=0, microsecond=0)


def runs_of(sessions: sessionmaker[Session], dag_id: str) -> list[DagRun]:
    with sessions() as session:
        query = select(DagRun).where(DagRun.dag_id == dag_id).order_by(DagRun.logical_date)
        return list(session.scalars(query))


def succeeded(
    sessions: sessionmaker[Session], dag_id: str, logical_dates: list[dt.datetime]
) -> bool:
    states = {r.logical_date: r.state for r in runs_of(sessions, dag_id)}
    return all(states.get(when) == "success" for when in logical_dates)


def assert_consecutive_intervals(runs: list[DagRun], first: dt.datetime) -> None:
    """One scheduled run per minute from ``first`` on, none twice, each covering its minute."""
    assert [r.logical_date for r in runs] == [first + i * MINUTE for i in range(len(runs))]
    for r in runs:
        assert (r.run_type, r.run_id) == ("scheduled", f"scheduled__{r.logical_date.isoformat()}")
        assert (r.data_interval_start, r.data_interval_end) == (
            r.logical_date,
            r.logical_date + MINUTE,
        )


def test_catchup_latest_only_and_max_active_runs_with_two_schedulers(
    services: Services,
    sessions: sessionmaker[Session],
    write_dag: Callable[[str, str], Path],
) -> None:
    before = dt.datetime.now(dt.UTC)
    start = floor_minute(before) - 3 * MINUTE  # three complete intervals back
    missed = [start + i * MINUTE for i in range(3)]
    dags = {
        "catchup": dict(catchup=True, max_active_runs=16, seconds=0),
        "latest": dict(catchup=False, max_active_runs=16, seconds=0),
        "one_at_a_time": dict(catchup=True, max_active_runs=1, seconds=2),
    }
    for dag_id, settings in dags.items():
        write_dag(f"e2e_{dag_id}", SOURCE.format(dag_id=dag_id, start=start, **settings))

    services.start("scheduler")
    services.start("scheduler2")
    services.start("worker", "--concurrency", "2")

    # max_active_runs=1: poll while its three runs go, never more than one queued or running.
    most_active = 0
    deadline = time.monotonic() + 120
    while not succeeded(sessions, "one_at_a_time", missed):
        assert time.monotonic() < deadline, [
            (r.logical_date, r.state) for r in runs_of(sessions, "one_at_a_time")
        ]
        active = [r for r in runs_of(sessions, "one_at_a_time") if r.state in ("queued", "running")]
        most_active = max(most_active, len(active))
        time.sleep(0.1)
    assert most_active == 1
    held = runs_of(sessions, "one_at_a_time")
    assert_consecutive_intervals(held, start)
    for earlier, later in itertools.pairwise(held[:3]):
        assert earlier.end_date is not None and later.start_date is not None
        assert earlier.end_date <= later.start_date  # one after the other, oldest first

    # catchup=True: exactly the missed intervals (and any minute that has ended since), once.
    wait_for(lambda: succeeded(sessions, "catchup", missed), timeout=60, what="the catchup runs")
    ended_before = floor_minute(dt.datetime.now(dt.UTC))
    runs = runs_of(sessions, "catchup")
    ended_after = floor_minute(dt.datetime.now(dt.UTC))
    assert_consecutive_intervals(runs, start)
    assert [r.logical_date for r in runs][:3] == missed
    # Every interval that has ended has its run (the scheduler may be a second behind).
    assert ended_before - MINUTE - start <= len(runs) * MINUTE <= ended_after - start

    # catchup=False: the first run is the latest complete interval when the schedulers started.
    latest = wait_for(lambda: runs_of(sessions, "latest"), timeout=60, what="the latest run")
    assert floor_minute(before) - MINUTE <= latest[0].logical_date
    assert missed[0] not in [r.logical_date for r in latest]
    assert missed[1] not in [r.logical_date for r in latest]
    assert_consecutive_intervals(latest, latest[0].logical_date)

    for name in ("scheduler", "scheduler2"):
        assert "Traceback" not in services.log(name), services.log(name)


LATEST_ONLY_SOURCE = """
import datetime
from deferral import DAG
from deferral.operators import EmptyOperator, LatestOnlyOperator

with DAG("latest_only", schedule="*/1 * * * *", start_date={start!r}, catchup=True) as dag:
    LatestOnlyOperator(task_id="latest_only") >> EmptyOperator(task_id="after")
    dag.get_task("after") >> EmptyOperator(task_id="final")
"""


def task_states(sessions: sessionmaker[Session], run_id: str) -> dict[str, TaskInstance]:
    with sessions() as session:
        query = select(TaskInstance).where(TaskInstance.run_id == run_id)
        return {ti.task_id: ti for ti in session.scalars(query)}


def test_latest_only_skips_downstream_in_all_but_the_latest_run(
    services: Services,
    sessions: sessionmaker[Session],
    write_dag: Callable[[str, str], Path],
) -> None:
    start = floor_minute(dt.datetime.now(dt.UTC)) - 3 * MINUTE
    write_dag("e2e_latest_only", LATEST_ONLY_SOURCE.format(start=start))
    services.start("scheduler")
    services.start("worker", "--concurrency", "2")
    missed = [start + i * MINUTE for i in range(3)]
    wait_for(lambda: succeeded(sessions, "latest_only", missed), timeout=90, what="three runs")
    manual = services.run("dags", "trigger", "latest_only")
    assert manual.returncode == 0, manual.stderr

    for run in runs_of(sessions, "latest_only")[:3]:
        tis = task_states(sessions, run.run_id)
        decided = tis["latest_only"]
        assert decided.state == "success"
        assert decided.start_date is not None and decided.end_date is not None
        # Its next interval, [end, end + 1 min], held the moment it decided: it was the latest.
        window = (run.logical_date + MINUTE, run.logical_date + 2 * MINUTE)
        inside = [
            window[0] < moment <= window[1] for moment in (decided.start_date, decided.end_date)
        ]
        if all(inside):
            assert (tis["after"].state, tis["final"].state) == ("success", "success")
        elif not any(inside):
            assert (tis["after"].state, tis["final"].state) == ("skipped", "skipped")
    # The two oldest runs were never the latest by the time they ran.
    for run in runs_of(sessions, "latest_only")[:2]:
        assert task_states(sessions, run.run_id)["after"].state == "skipped"

    manual_run = wait_for(
        lambda: [
            r
            for r in runs_of(sessions, "latest_only")
            if r.run_type == "manual" and r.state == "success"
        ],
        timeout=60,
        what="the manual run",
    )[0]
    assert {t: ti.state for t, ti in task_states(sessions, manual_run.run_id).items()} == {
        "latest_only": "success",
        "after": "success",
        "final": "success",
    }
