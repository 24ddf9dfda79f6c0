"""The pure decisions of scheduler.dagruns."""

from __future__ import annotations

import datetime as dt

from deferral import DAG
from deferral.timetables import DataInterval
from scheduler.dagruns import DEFAULT_MAX_ACTIVE_RUNS, QueuedDag, runs_to_create, timed_out

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


def test_a_dags_room_is_its_limit_less_its_running_runs_never_below_zero() -> None:
    assert QueuedDag("a", 3, False, running=1).room() == 2
    assert QueuedDag("a", 3, False, running=3).room() == 0
    assert QueuedDag("a", 3, False, running=5).room() == 0  # limit lowered below the running
    assert QueuedDag("a", None, False, running=1).room() == DEFAULT_MAX_ACTIVE_RUNS - 1


def test_timed_out_is_strictly_past_the_timeout() -> None:
    timeout = dt.timedelta(hours=1)
    assert timed_out(day(1), timeout, day(1) + dt.timedelta(hours=1, seconds=1))
    assert not timed_out(day(1), timeout, day(1) + timeout)


def test_runs_to_create_at_most_so_many_a_call_and_the_rest_later() -> None:
    dag = DAG("daily", schedule="@daily", start_date=day(1), catchup=True, max_active_runs=100)
    due, following = runs_to_create(dag, None, active=0, now=day(10), at_most=3)
    assert [info.logical_date for info in due] == [day(1), day(2), day(3)]
    assert following is not None and following.logical_date == day(4)  # due: the next call's
    rest, _ = runs_to_create(dag, due[-1].data_interval, active=3, now=day(10), at_most=3)
    assert [info.logical_date for info in rest] == [day(4), day(5), day(6)]
