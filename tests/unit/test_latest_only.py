"""LatestOnlyOperator: Airflow 2.x's latest_only decision, pure."""

from __future__ import annotations

import dataclasses
import datetime as dt

import pytest

from deferral import DAG
from deferral.context import DagRunInfo
from deferral.operators import EmptyOperator, LatestOnlyOperator, is_latest_run
from tests.unit.test_operators import make_context

UTC = dt.UTC


def day(n: int, hour: int = 0) -> dt.datetime:
    return dt.datetime(2024, 1, n, hour, tzinfo=UTC)


DAILY = DAG("daily", schedule="@daily", start_date=day(1))


def scheduled(n: int, run_type: str = "scheduled") -> DagRunInfo:
    """The run of the interval [day n, day n+1)."""
    return DagRunInfo("daily", f"run{n}", day(n), {}, day(n), day(n + 1), run_type)


@pytest.mark.parametrize(
    ("now", "latest"),
    [
        (day(10, 6), True),  # the run of the 9th is created on the 10th: the latest that day
        (day(11), True),  # the window's end is included
        (day(10), False),  # its start is not
        (day(11, 1), False),  # the run of the 10th has taken over
        (day(9, 12), False),  # before its own interval has ended
    ],
)
def test_a_scheduled_run_is_latest_while_the_next_interval_holds_now(
    now: dt.datetime, latest: bool
) -> None:
    assert is_latest_run(DAILY, scheduled(9), now) is latest


def test_backfill_runs_are_checked_like_scheduled_ones_manual_runs_never_skip() -> None:
    assert is_latest_run(DAILY, scheduled(1, "backfill"), day(20)) is False
    assert is_latest_run(DAILY, scheduled(1, "manual"), day(20)) is True


def test_a_schedule_without_a_next_run_never_skips() -> None:
    once = DAG("once", schedule="@once", start_date=day(1))
    run = DagRunInfo("once", "r", day(1), {}, day(1), day(1), "scheduled")
    assert is_latest_run(once, run, day(20)) is True


def test_latest_only_skips_every_direct_downstream_task_when_not_latest() -> None:
    with DAG("d", schedule="@daily", start_date=day(1)) as dag:
        latest = LatestOnlyOperator(task_id="latest")
        a, b, c = (EmptyOperator(task_id=t) for t in "abc")
        latest >> [a, b]
        a >> c
    context = make_context(latest)
    old = dataclasses.replace(scheduled(1), dag_id=dag.dag_id)
    context["dag_run"] = old
    assert latest.execute(context) == []
    assert context["ti"].skip_task_ids == {"a", "b"}  # c follows by its trigger rule

    context = make_context(latest)
    context["dag_run"] = dataclasses.replace(old, run_type="manual")
    assert latest.execute(context) == ["a", "b"]
    assert context["ti"].skip_task_ids == set()
