"""The pure decisions of scheduler.dagruns."""

from __future__ import annotations

import datetime as dt

from deferral import DAG
from deferral.timetables import DataInterval
from scheduler.dagruns import QueuedRun, runs_to_create, runs_to_start, timed_out

UTC = dt.UTC


def day(n: int) -> dt.datetime:
    return dt.datetime(2024, 1, n, tzinfo=UTC)


def test_runs_to_create_stops_at_max_active_runs_and_names_the_next() -> None:
    dag = DAG("d", schedule="@daily", start_date=day(1), catchup=True, max_active_runs=3)
    due, following = runs_to_create(dag, None, active=1, now=day(10))
    assert [i.logical_date for i in due] == [day(1), day(2)]
    assert following is not None and following.logical_date == day(3)


def test_runs_to_create_after_the_last_run_and_nothing_before_its_interval_ends() -> None:
    dag = DAG("d", schedule="@daily", start_date=day(1), catchup=True)
    due, following = runs_to_create(dag, DataInterval(day(8), day(9)), active=0, now=day(9))
    assert due == [] and following is not None
    assert (following.logical_date, following.run_after) == (day(9), day(10))


def test_runs_to_create_ends_with_the_end_date() -> None:
    dag = DAG("d", schedule="@daily", start_date=day(1), end_date=day(2), catchup=True)
    due, following = runs_to_create(dag, None, active=0, now=day(10))
    assert [i.logical_date for i in due] == [day(1), day(2)] and following is None


def test_runs_to_start_fills_each_dag_up_to_its_limit_oldest_first() -> None:
    queued = [QueuedRun(1, "a", 1), QueuedRun(2, "a", 1), QueuedRun(3, "b", 2)]
    queued += [QueuedRun(4, "b", 2), QueuedRun(5, "b", 2)]
    assert runs_to_start(queued, {}) == [1, 3, 4]
    assert runs_to_start(queued, {"a": 1, "b": 1}) == [3]


def test_timed_out_is_strictly_past_the_timeout() -> None:
    timeout = dt.timedelta(hours=1)
    assert timed_out(day(1), timeout, day(1) + dt.timedelta(hours=1, seconds=1))
    assert not timed_out(day(1), timeout, day(1) + timeout)
