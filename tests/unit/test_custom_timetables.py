"""A DAG file's own Timetable, written as Airflow's docs ("Customizing DAG scheduling with
timetables") write AfterWorkdayTimetable: given as ``schedule=`` (or the deprecated
``timetable=``), it decides the scheduled runs, manual runs' intervals and backfills; one that
raises or returns naive date-times refuses its DAG at load, naming it, and one that fails later
gives its DAG no next run without harming others."""

from __future__ import annotations

import datetime as dt
import logging

import pytest

from deferral import DAG
from deferral.exceptions import DagDefinitionError
from deferral.timetables import infos_between
from deferral.timetables.base import DagRunInfo, DataInterval, TimeRestriction, Timetable

UTC = dt.UTC
FRIDAY = dt.datetime(2024, 3, 1, tzinfo=UTC)
MONDAY = dt.datetime(2024, 3, 4, tzinfo=UTC)
HOLIDAYS = {dt.date(2024, 3, 5)}


class AfterWorkdayTimetable(Timetable):
    """Runs after each workday, covering that day (Airflow's docs' example, with datetime in
    place of pendulum and a fixed holiday list)."""

    def get_next_workday(self, day: dt.datetime, incr: int = 1) -> dt.datetime:
        next_start = day
        while next_start.weekday() >= 5 or next_start.date() in HOLIDAYS:
            next_start = next_start + dt.timedelta(days=incr)
        return next_start

    def infer_manual_data_interval(self, run_after: dt.datetime) -> DataInterval:
        start = dt.datetime.combine((run_after - dt.timedelta(days=1)).date(), dt.time.min)
        start = self.get_next_workday(start.replace(tzinfo=UTC), incr=-1)
        return DataInterval(start=start, end=(start + dt.timedelta(days=1)))

    def next_dagrun_info(
        self,
        *,
        last_automated_data_interval: DataInterval | None,
        restriction: TimeRestriction,
    ) -> DagRunInfo | None:
        if last_automated_data_interval is not None:
            last_start = last_automated_data_interval.start
            next_start = dt.datetime.combine(
                (last_start + dt.timedelta(days=1)).date(), dt.time.min
            )
        else:
            earliest = restriction.earliest
            if earliest is None:
                return None
            next_start = earliest.replace(tzinfo=None)
            if not restriction.catchup:
                today = dt.datetime.combine(dt.datetime.now(UTC).date(), dt.time.min)
                next_start = max(next_start, today)
            elif next_start.time() != dt.time.min:
                next_start = dt.datetime.combine(
                    next_start.date() + dt.timedelta(days=1), dt.time.min
                )
        next_start = self.get_next_workday(next_start.replace(tzinfo=UTC))
        if restriction.latest is not None and next_start > restriction.latest:
            return None
        return DagRunInfo.interval(start=next_start, end=(next_start + dt.timedelta(days=1)))


def workday_dag(**kwargs: object) -> DAG:
    arguments: dict[str, object] = {
        "schedule": AfterWorkdayTimetable(),
        "start_date": FRIDAY,
        "catchup": True,
    }
    arguments.update(kwargs)
    return DAG("example_workday_timetable", **arguments)  # type: ignore[arg-type]


def test_scheduled_runs_follow_the_dags_own_timetable() -> None:
    dag = workday_dag()
    first = dag.next_dagrun_info(None, now=MONDAY)
    assert first is not None
    assert first.data_interval == DataInterval(FRIDAY, FRIDAY + dt.timedelta(days=1))
    assert first.run_after == FRIDAY + dt.timedelta(days=1)
    # Over the weekend, then over the holiday on Tuesday.
    second = dag.next_dagrun_info(first.data_interval, now=MONDAY)
    assert second is not None and second.logical_date == MONDAY
    third = dag.next_dagrun_info(second.data_interval, now=MONDAY)
    assert third is not None and third.logical_date == MONDAY + dt.timedelta(days=2)
    assert dag.timetable.summary == "AfterWorkdayTimetable"


def test_manual_runs_and_backfills_use_it_too() -> None:
    dag = workday_dag()
    sunday = FRIDAY + dt.timedelta(days=2, hours=9)
    assert dag.infer_manual_data_interval(sunday) == DataInterval(
        FRIDAY, FRIDAY + dt.timedelta(days=1)
    )
    backfill = infos_between(dag.timetable, FRIDAY, MONDAY + dt.timedelta(days=3))
    assert [info.logical_date.day for info in backfill] == [1, 4, 6, 7]


def test_the_deprecated_timetable_argument_is_schedule() -> None:
    with pytest.warns(DeprecationWarning, match="timetable is deprecated"):
        dag = DAG("tt_arg", timetable=AfterWorkdayTimetable(), start_date=FRIDAY, catchup=True)
    assert isinstance(dag.timetable, AfterWorkdayTimetable)
    with pytest.raises(DagDefinitionError, match="give one of schedule, timetable, not both"):
        DAG("tt_both", schedule="@daily", timetable=AfterWorkdayTimetable(), start_date=FRIDAY)
    with pytest.raises(DagDefinitionError, match="timetable must be a Timetable, got str"):
        DAG("tt_str", timetable="@daily", start_date=FRIDAY)  # type: ignore[arg-type]


class NaiveTimetable(AfterWorkdayTimetable):
    def infer_manual_data_interval(self, run_after: dt.datetime) -> DataInterval:
        return DataInterval(dt.datetime(2024, 1, 1), dt.datetime(2024, 1, 2))


class BrokenTimetable(AfterWorkdayTimetable):
    def next_dagrun_info(self, **kwargs: object) -> DagRunInfo | None:
        raise ValueError("no calendar")


def test_a_timetable_that_fails_refuses_its_dag_at_load_naming_it() -> None:
    with pytest.raises(DagDefinitionError) as naive:
        workday_dag(schedule=NaiveTimetable())
    assert str(naive.value).startswith(
        "DAG 'example_workday_timetable': timetable NaiveTimetable.infer_manual_data_interval "
        "returned datetime.datetime(2024, 1, 1, 0, 0), not a tz-aware datetime"
    )
    with pytest.raises(DagDefinitionError, match=r"BrokenTimetable.next_dagrun_info raised "):
        workday_dag(schedule=BrokenTimetable())


class FailsLaterTimetable(AfterWorkdayTimetable):
    def next_dagrun_info(
        self,
        *,
        last_automated_data_interval: DataInterval | None,
        restriction: TimeRestriction,
    ) -> DagRunInfo | None:
        if last_automated_data_interval is not None:
            raise RuntimeError("calendar service down")
        return super().next_dagrun_info(last_automated_data_interval=None, restriction=restriction)


def test_one_that_fails_later_gives_its_dag_no_next_run_saying_why(
    caplog: pytest.LogCaptureFixture,
) -> None:
    dag = workday_dag(schedule=FailsLaterTimetable())
    first = dag.next_dagrun_info(None, now=MONDAY)
    assert first is not None
    with caplog.at_level(logging.ERROR, logger="deferral"):
        assert dag.next_dagrun_info(first.data_interval, now=MONDAY) is None
    assert "calendar service down" in caplog.text and "example_workday_timetable" in caplog.text
