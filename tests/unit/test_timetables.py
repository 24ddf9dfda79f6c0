"""deferral.timetables and the schedule arguments of DAG: Airflow 2.x semantics, pure."""

from __future__ import annotations

import datetime as dt
import zoneinfo
from typing import Any

import pytest
from dateutil.relativedelta import relativedelta

from deferral import DAG
from deferral.assets import Asset
from deferral.exceptions import DagDefinitionError
from deferral.timetables import (
    ContinuousTimetable,
    CronDataIntervalTimetable,
    DagRunInfo,
    DataInterval,
    DeltaDataIntervalTimetable,
    NullTimetable,
    OnceTimetable,
    TimeRestriction,
    infos_between,
)
from deferral.timetables.assets import AssetOrTimeSchedule
from deferral.timetables.serialized import deserialize_timetable
from deferral.timetables.trigger import CronTriggerTimetable
from deferral.timetables.workday import AfterWorkdayTimetable

UTC = dt.UTC
ZURICH = zoneinfo.ZoneInfo("Europe/Zurich")


def at(*args: int, tz: dt.tzinfo = UTC) -> dt.datetime:
    return dt.datetime(*args, tzinfo=tz)  # type: ignore[misc]


def interval(start: dt.datetime, end: dt.datetime) -> DagRunInfo:
    return DagRunInfo.interval(start, end)


def runs(dag: DAG, now: dt.datetime, count: int = 10) -> list[DagRunInfo]:
    """The runs the scheduler would create by ``now``, one after the other."""
    infos: list[DagRunInfo] = []
    last = None
    while len(infos) < count:
        info = dag.next_dagrun_info(last, now=now)
        if info is None or info.run_after > now:
            break
        infos.append(info)
        last = info.data_interval
    return infos


# -- cron and presets -----------------------------------------------------------------------------


def test_daily_with_catchup_covers_every_interval_since_the_start_date() -> None:
    dag = DAG("d", schedule="@daily", start_date=at(2024, 1, 1), catchup=True)
    assert runs(dag, now=at(2024, 1, 3, 12)) == [
        interval(at(2024, 1, 1), at(2024, 1, 2)),
        interval(at(2024, 1, 2), at(2024, 1, 3)),
    ]
    # The next one is known in advance: it runs once its interval has ended.
    last = DataInterval(at(2024, 1, 2), at(2024, 1, 3))
    assert dag.next_dagrun_info(last, now=at(2024, 1, 3, 12)) == interval(
        at(2024, 1, 3), at(2024, 1, 4)
    )


def test_a_start_date_between_schedule_points_waits_for_the_next_point() -> None:
    dag = DAG("d", schedule="0 0 * * *", start_date=at(2024, 1, 1, 10, 30), catchup=True)
    assert dag.next_dagrun_info(None, now=at(2024, 1, 5)) == interval(
        at(2024, 1, 2), at(2024, 1, 3)
    )


@pytest.mark.parametrize(
    "now",
    [at(2024, 1, 10, 15), at(2024, 1, 10)],  # between two schedule points, and right on one
)
def test_catchup_false_creates_only_the_latest_complete_interval(now: dt.datetime) -> None:
    dag = DAG("d", schedule="@daily", start_date=at(2024, 1, 1))
    assert dag.catchup is False
    assert runs(dag, now=now) == [interval(at(2024, 1, 9), at(2024, 1, 10))]


def test_catchup_false_continues_from_the_last_run() -> None:
    dag = DAG("d", schedule="@daily", start_date=at(2024, 1, 1))
    last = DataInterval(at(2024, 1, 9), at(2024, 1, 10))
    assert dag.next_dagrun_info(last, now=at(2024, 1, 10, 15)) == interval(
        at(2024, 1, 10), at(2024, 1, 11)
    )
    # After a long stop, the missed intervals are skipped, not caught up.
    assert dag.next_dagrun_info(last, now=at(2024, 2, 1, 15)) == interval(
        at(2024, 1, 31), at(2024, 2, 1)
    )


def test_catchup_false_with_a_future_start_date_starts_there() -> None:
    dag = DAG("d", schedule="@daily", start_date=at(2024, 3, 1, 6))
    assert dag.next_dagrun_info(None, now=at(2024, 1, 1)) == interval(
        at(2024, 3, 2), at(2024, 3, 3)
    )


def test_end_date_is_the_last_logical_date() -> None:
    dag = DAG(
        "d", schedule="@daily", start_date=at(2024, 1, 1), end_date=at(2024, 1, 3), catchup=True
    )
    assert [i.logical_date for i in runs(dag, now=at(2024, 2, 1))] == [
        at(2024, 1, 1),
        at(2024, 1, 2),
        at(2024, 1, 3),
    ]


@pytest.mark.parametrize(
    ("schedule", "start", "end"),
    [
        ("@hourly", at(2024, 1, 1), at(2024, 1, 1, 1)),
        ("@weekly", at(2024, 1, 7), at(2024, 1, 14)),  # Sundays
        ("@monthly", at(2024, 1, 1), at(2024, 2, 1)),
        ("@quarterly", at(2024, 1, 1), at(2024, 4, 1)),
        ("@yearly", at(2024, 1, 1), at(2025, 1, 1)),
        ("*/15 * * * *", at(2024, 1, 1), at(2024, 1, 1, 0, 15)),
    ],
)
def test_presets_and_cron_expressions(schedule: str, start: dt.datetime, end: dt.datetime) -> None:
    dag = DAG("d", schedule=schedule, start_date=at(2024, 1, 1), catchup=True)
    assert dag.next_dagrun_info(None, now=at(2030, 1, 1)) == interval(start, end)
    assert dag.timetable.summary == schedule


def test_manual_run_of_a_cron_dag_covers_the_last_complete_interval() -> None:
    timetable = CronDataIntervalTimetable("@daily", UTC)
    # Triggered at 1am on the 25th: the 24th. Right on midnight: also the day that just ended.
    assert timetable.infer_manual_data_interval(run_after=at(2024, 1, 25, 1)) == DataInterval(
        at(2024, 1, 24), at(2024, 1, 25)
    )
    assert timetable.infer_manual_data_interval(run_after=at(2024, 1, 25)) == DataInterval(
        at(2024, 1, 24), at(2024, 1, 25)
    )


# -- timedelta -------------------------------------------------------------------------------------


def test_timedelta_intervals_start_at_the_start_date() -> None:
    dag = DAG("d", schedule=dt.timedelta(hours=1), start_date=at(2024, 1, 1, 10, 7), catchup=True)
    assert runs(dag, now=at(2024, 1, 1, 12, 30)) == [
        interval(at(2024, 1, 1, 10, 7), at(2024, 1, 1, 11, 7)),
        interval(at(2024, 1, 1, 11, 7), at(2024, 1, 1, 12, 7)),
    ]


def test_timedelta_without_catchup_takes_the_latest_interval_on_the_epoch_grid() -> None:
    # Airflow 2 counts the latest complete interval from the epoch, not from the start date.
    dag = DAG("d", schedule=dt.timedelta(hours=1), start_date=at(2024, 1, 1, 10, 7))
    assert runs(dag, now=at(2024, 1, 1, 13, 30)) == [
        interval(at(2024, 1, 1, 12), at(2024, 1, 1, 13))
    ]


def test_timedelta_manual_interval_ends_at_the_trigger_time() -> None:
    timetable = DeltaDataIntervalTimetable(dt.timedelta(hours=6))
    assert timetable.infer_manual_data_interval(run_after=at(2024, 1, 1, 10)) == DataInterval(
        at(2024, 1, 1, 4), at(2024, 1, 1, 10)
    )


def test_relativedelta_schedules_step_by_calendar_months() -> None:
    dag = DAG("d", schedule=relativedelta(months=1), start_date=at(2024, 1, 31), catchup=True)
    first = dag.next_dagrun_info(None, now=at(2025, 1, 1))
    assert first == interval(at(2024, 1, 31), at(2024, 2, 29))


# -- time zones and DST ----------------------------------------------------------------------------


def test_naive_start_date_is_read_in_the_default_timezone_and_cron_keeps_local_midnight(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("DEFERRAL_DEFAULT_TIMEZONE", "Europe/Zurich")
    dag = DAG("d", schedule="@daily", start_date=dt.datetime(2024, 3, 30), catchup=True)
    assert dag.start_date == at(2024, 3, 30, tz=ZURICH)
    infos = runs(dag, now=at(2024, 4, 2))
    # Local midnight each day: 24 hours, then 23 on the day DST starts.
    assert [(i.data_interval.start, i.data_interval.end) for i in infos[:2]] == [
        (at(2024, 3, 29, 23), at(2024, 3, 30, 23)),
        (at(2024, 3, 30, 23), at(2024, 3, 31, 22)),
    ]


def test_a_wall_time_skipped_by_dst_moves_forward(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DEFERRAL_DEFAULT_TIMEZONE", "Europe/Zurich")
    dag = DAG("d", schedule="30 2 * * *", start_date=dt.datetime(2024, 3, 30), catchup=True)
    ends = [i.data_interval.end for i in runs(dag, now=at(2024, 4, 3))]
    # 2:30 does not exist on 31 March in Zurich: that run is at 3:30 local (01:30 UTC).
    assert ends[:3] == [at(2024, 3, 31, 1, 30), at(2024, 4, 1, 0, 30), at(2024, 4, 2, 0, 30)]


def test_hourly_cron_has_every_hour_of_the_day_dst_ends(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DEFERRAL_DEFAULT_TIMEZONE", "Europe/Zurich")
    dag = DAG("d", schedule="0 * * * *", start_date=dt.datetime(2024, 10, 27), catchup=True)
    # Up to midnight local time at the end of 27 October 2024, a day of 25 hours in Zurich.
    infos = runs(dag, now=at(2024, 10, 27, 23), count=100)
    assert len(infos) == 25
    assert all(i.data_interval.end - i.data_interval.start == dt.timedelta(hours=1) for i in infos)


def test_timedelta_is_an_absolute_duration_across_dst(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DEFERRAL_DEFAULT_TIMEZONE", "Europe/Zurich")
    dag = DAG("d", schedule=dt.timedelta(days=1), start_date=dt.datetime(2024, 3, 30), catchup=True)
    second = runs(dag, now=at(2024, 4, 3))[1]
    assert second.data_interval.end - second.data_interval.start == dt.timedelta(hours=24)


def test_cron_runs_in_the_zone_of_an_aware_start_date(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DEFERRAL_DEFAULT_TIMEZONE", "UTC")
    dag = DAG("d", schedule="@daily", start_date=at(2024, 1, 1, tz=ZURICH), catchup=True)
    assert dag.next_dagrun_info(None, now=at(2024, 2, 1)) == interval(
        at(2023, 12, 31, 23), at(2024, 1, 1, 23)
    )


# -- @once, None, @continuous ----------------------------------------------------------------------


def test_once_runs_at_the_start_date_whatever_catchup_says() -> None:
    dag = DAG("d", schedule="@once", start_date=at(2024, 1, 1, 8))
    first = dag.next_dagrun_info(None, now=at(2024, 6, 1))
    assert first == DagRunInfo.exact(at(2024, 1, 1, 8))
    assert dag.next_dagrun_info(first.data_interval, now=at(2024, 6, 1)) is None
    assert isinstance(dag.timetable, OnceTimetable)


def test_schedule_none_never_runs_and_manual_runs_cover_an_instant() -> None:
    dag = DAG("d")
    assert isinstance(dag.timetable, NullTimetable) and not dag.timetable.can_be_scheduled
    assert dag.next_dagrun_info(None, now=at(2024, 1, 1)) is None
    assert dag.timetable.infer_manual_data_interval(run_after=at(2024, 1, 1)) == DataInterval(
        at(2024, 1, 1), at(2024, 1, 1)
    )


def test_continuous_covers_the_time_since_the_previous_run() -> None:
    restriction = TimeRestriction(at(2024, 1, 1), None, catchup=False)
    timetable = ContinuousTimetable()
    first = timetable.next_dagrun_info(
        last_automated_data_interval=None, restriction=restriction, now=at(2024, 1, 5)
    )
    assert first == interval(at(2024, 1, 1), at(2024, 1, 5))
    assert timetable.next_dagrun_info(
        last_automated_data_interval=first.data_interval,
        restriction=restriction,
        now=at(2024, 1, 6),
    ) == interval(at(2024, 1, 5), at(2024, 1, 6))


# -- backfill -----------------------------------------------------------------------------------


def test_infos_between_includes_both_ends_and_aligns_the_start() -> None:
    timetable = CronDataIntervalTimetable("@daily", UTC)
    infos = infos_between(timetable, at(2024, 1, 1, 5), at(2024, 1, 4))
    assert [i.logical_date for i in infos] == [at(2024, 1, 2), at(2024, 1, 3), at(2024, 1, 4)]


def test_infos_between_of_schedule_none_is_empty_and_of_continuous_is_finite() -> None:
    assert infos_between(NullTimetable(), at(2024, 1, 1), at(2024, 1, 4)) == []
    continuous = infos_between(ContinuousTimetable(), at(2024, 1, 1), at(2024, 1, 4))
    assert [i.logical_date for i in continuous] == [at(2024, 1, 1), at(2024, 1, 4)]


# -- DAG arguments --------------------------------------------------------------------------------


def test_dag_defaults_follow_the_issue() -> None:
    dag = DAG("d", schedule="@daily", start_date=at(2024, 1, 1))
    assert (dag.catchup, dag.max_active_runs, dag.dagrun_timeout) == (False, 16, None)
    assert dag.is_paused_upon_creation is None
    assert DAG("none").schedule is None


def test_schedule_interval_is_the_deprecated_alias() -> None:
    with pytest.warns(DeprecationWarning, match="schedule_interval"):
        dag = DAG("d", schedule_interval="@hourly", start_date=at(2024, 1, 1))
    assert dag.schedule == dag.schedule_interval == "@hourly"


def test_start_date_may_come_from_default_args() -> None:
    dag = DAG("d", schedule="@daily", default_args={"start_date": at(2024, 1, 1)})
    assert dag.start_date == at(2024, 1, 1)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"schedule": "not a cron"}, "'not a cron' is not a cron expression"),
        ({"schedule": "61 * * * *"}, "is not a cron expression"),
        ({"schedule": dt.timedelta(0)}, "schedule interval must be positive"),
        ({"schedule": 5}, "schedule must be a cron expression.*not int"),
        ({"schedule": "@daily", "schedule_interval": "@daily"}, "not both"),
        ({"schedule": "@daily", "start_date": None}, "schedule '@daily' needs a start_date"),
        ({"start_date": "2024-01-01"}, "start_date must be a datetime, not str"),
        ({"end_date": at(2023, 1, 1)}, "end_date is before start_date"),
        ({"max_active_runs": 0}, "max_active_runs must be an int >= 1"),
        ({"dagrun_timeout": 60}, "dagrun_timeout must be a timedelta"),
        ({"catchup": "yes"}, "catchup must be True or False"),
        ({"schedule": "@continuous"}, "'@continuous' needs max_active_runs=1"),
    ],
)
def test_bad_schedule_arguments_name_the_dag_and_the_argument(
    kwargs: dict[str, object], message: str
) -> None:
    arguments: dict[str, object] = {"schedule": "@daily", "start_date": at(2024, 1, 1), **kwargs}
    with pytest.raises(DagDefinitionError, match=f"DAG 'bad': .*{message}"):
        DAG("bad", **arguments)  # type: ignore[arg-type]


# -- Airflow 3: CronTriggerTimetable, AssetOrTimeSchedule ------------------------------------------


def test_cron_trigger_runs_at_each_point_with_that_point_as_its_logical_date() -> None:
    every_wednesday = CronTriggerTimetable("0 1 * * 3", timezone="UTC")
    dag = DAG("d", schedule=every_wednesday, start_date=at(2024, 1, 1), catchup=True)
    assert runs(dag, now=at(2024, 1, 17, 12)) == [
        DagRunInfo.exact(at(2024, 1, 3, 1)),
        DagRunInfo.exact(at(2024, 1, 10, 1)),
        DagRunInfo.exact(at(2024, 1, 17, 1)),
    ]
    # Without catchup: the latest point passed, then each next one.
    dag = DAG("d2", schedule=every_wednesday, start_date=at(2024, 1, 1))
    assert runs(dag, now=at(2024, 1, 17, 12)) == [DagRunInfo.exact(at(2024, 1, 17, 1))]
    # A manual run covers the instant it is triggered at (or the interval before it).
    assert every_wednesday.infer_manual_data_interval(run_after=at(2024, 1, 5)) == (
        DataInterval.exact(at(2024, 1, 5))
    )
    hourly = CronTriggerTimetable("@hourly", timezone=ZURICH, interval=dt.timedelta(hours=1))
    assert hourly.next_dagrun_info(
        last_automated_data_interval=None,
        restriction=TimeRestriction(at(2024, 1, 1), None, True),
        now=at(2024, 1, 1, 5),
    ) == interval(at(2023, 12, 31, 23), at(2024, 1, 1))


def test_asset_or_time_schedule_runs_by_the_clock_and_on_its_assets() -> None:
    a, b = Asset("a"), Asset("b")
    schedule = AssetOrTimeSchedule(
        timetable=CronTriggerTimetable("0 1 * * 3", timezone="UTC"), assets=(a & b)
    )
    dag = DAG("d", schedule=schedule, start_date=at(2024, 1, 1), catchup=True)
    assert dag.asset_condition is not None and dag.asset_condition.summary() == "a & b"
    assert dag.timetable.summary == "a & b or 0 1 * * 3"
    assert runs(dag, now=at(2024, 1, 4)) == [DagRunInfo.exact(at(2024, 1, 3, 1))]
    as_list = AssetOrTimeSchedule(timetable=NullTimetable(), assets=[a, b])
    assert as_list.condition.summary() == "a & b" and not as_list.can_be_scheduled


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: CronTriggerTimetable("nope", timezone="UTC"), "'nope' is not a cron expression"),
        (lambda: CronTriggerTimetable("@daily", timezone="Mars/Base"), "is not a time zone"),
        (
            lambda: CronTriggerTimetable("@daily", timezone="UTC", interval=dt.timedelta(-1)),
            "interval must be a timedelta of 0 or more",
        ),
        (
            lambda: AssetOrTimeSchedule(timetable="@daily", assets=[Asset("a")]),
            "timetable must be a Timetable, got str",
        ),
    ],
)
def test_bad_airflow_3_timetables_are_refused_naming_the_argument(build: Any, message: str) -> None:
    with pytest.raises((ValueError, TypeError), match=message):
        build()


# -- AfterWorkdayTimetable (Airflow's example plugin) ----------------------------------------------


def _day(day: int, hour: int = 0) -> dt.datetime:
    """A day of May 2024 (the 3rd a Friday, the 4th and 5th a weekend, the 6th a Monday)."""
    return dt.datetime(2024, 5, day, hour, tzinfo=UTC)


@pytest.mark.parametrize(
    ("last", "restriction", "now", "start"),
    [
        # after Friday's run: Monday's
        (DataInterval(_day(3), _day(4)), TimeRestriction(_day(1), None, True), _day(9), _day(6)),
        # the first run from a Saturday start: Monday's
        (None, TimeRestriction(_day(4), None, True), _day(9), _day(6)),
        # a start during the day: the next (working) day
        (None, TimeRestriction(_day(2, 9), None, True), _day(9), _day(3)),
        # no catchup: today's, on a Sunday the next Monday's
        (None, TimeRestriction(_day(1), None, False), _day(5, 15), _day(6)),
        # over the end date: none
        (DataInterval(_day(3), _day(4)), TimeRestriction(_day(1), _day(5), True), _day(9), None),
        (None, TimeRestriction(None, None, True), _day(9), None),
    ],
)
def test_after_workday_runs_each_working_day(
    last: DataInterval | None,
    restriction: TimeRestriction,
    now: dt.datetime,
    start: dt.datetime | None,
) -> None:
    info = AfterWorkdayTimetable().next_dagrun_info(
        last_automated_data_interval=last, restriction=restriction, now=now
    )
    assert info == (None if start is None else DagRunInfo.interval(start, start + dt.timedelta(1)))


def test_after_workday_triggered_by_hand_is_the_last_working_day_before() -> None:
    timetable = AfterWorkdayTimetable()
    assert timetable.infer_manual_data_interval(run_after=_day(6, 12)) == DataInterval(
        _day(3), _day(4)
    )
    assert timetable.infer_manual_data_interval(run_after=_day(8, 1)) == DataInterval(
        _day(7), _day(8)
    )
    assert isinstance(deserialize_timetable(timetable.serialize() or {}), AfterWorkdayTimetable)
