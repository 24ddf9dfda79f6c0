"""Pendulum date-times and durations, as Airflow's example DAGs write them, accepted wherever a
datetime or timedelta is, and turned into the standard types deferral computes with."""

from __future__ import annotations

import datetime as dt
from typing import Any
from zoneinfo import ZoneInfo

import pendulum
import pytest
from dateutil.relativedelta import relativedelta

from deferral import DAG
from deferral.operators import EmptyOperator
from deferral.runtime import serialization
from deferral.sensors import DateTimeSensor, TimeDeltaSensor
from deferral.timetables import DagRunInfo
from deferral.timezone import calendar_delta, make_aware, standard_datetime, standard_timedelta
from deferral.triggers import DateTimeTrigger
from tests.unit.test_operators import make_context

PARIS = ZoneInfo("Europe/Paris")


def runs(dag: DAG, now: dt.datetime, count: int) -> list[DagRunInfo]:
    infos: list[DagRunInfo] = []
    last = None
    while len(infos) < count:
        info = dag.next_dagrun_info(last, now=now)
        if info is None:
            break
        infos.append(info)
        last = info.data_interval
    return infos


@pytest.mark.parametrize(
    "moment",
    [
        pendulum.datetime(2024, 3, 31, 1, 30, tz="Europe/Paris"),
        pendulum.datetime(2021, 1, 1, tz="UTC"),
        pendulum.datetime(2021, 1, 1, 5, tz=pendulum.fixed_timezone(-3 * 3600)),
        pendulum.now("Asia/Kolkata"),
    ],
)
def test_a_pendulum_datetime_round_trips_as_a_tz_aware_datetime(moment: pendulum.DateTime) -> None:
    back = serialization.loads(serialization.dumps({"when": moment}))["when"]
    assert type(back) is dt.datetime
    assert back == moment
    assert back.utcoffset() == moment.utcoffset()
    if isinstance(moment.tzinfo, ZoneInfo):
        assert back.tzinfo == ZoneInfo(moment.tzinfo.key)


def test_a_pendulum_duration_round_trips_as_a_timedelta() -> None:
    duration = pendulum.duration(days=2, hours=3, microseconds=5)
    back = serialization.loads(serialization.dumps((duration,)))[0]
    assert type(back) is dt.timedelta
    assert back == dt.timedelta(days=2, hours=3, microseconds=5)


def test_defer_kwargs_and_xcoms_take_pendulum_values() -> None:
    kwargs = {"since": pendulum.datetime(2024, 1, 1, tz="UTC"), "every": pendulum.duration(hours=1)}
    checked = serialization.check_kwargs(kwargs)
    assert serialization.loads(serialization.encode(checked)) == kwargs


def test_standard_datetime_keeps_the_wall_time_and_the_zone() -> None:
    moment = standard_datetime(pendulum.datetime(2024, 3, 30, 12, tz="Europe/Paris"))
    assert type(moment) is dt.datetime
    assert moment.tzinfo == PARIS
    # A wall day, as datetime adds it (pendulum's DateTime would add 24 hours: 13:00).
    assert (moment + dt.timedelta(days=1)).hour == 12


def test_a_naive_datetime_is_still_read_in_the_default_zone() -> None:
    assert make_aware(dt.datetime(2024, 1, 1)).tzinfo is not None
    assert standard_datetime(dt.datetime(2024, 1, 1)) == dt.datetime(2024, 1, 1)


def test_a_duration_of_months_is_a_calendar_delta() -> None:
    assert calendar_delta(pendulum.duration(months=1, days=2, hours=3)) == relativedelta(
        months=1, days=2, hours=3
    )
    assert calendar_delta(pendulum.duration(years=1)) == relativedelta(years=1)
    plain = calendar_delta(pendulum.duration(hours=6))
    assert type(plain) is dt.timedelta and plain == dt.timedelta(hours=6)
    assert standard_timedelta(pendulum.duration(weeks=1)) == dt.timedelta(days=7)


def test_a_dag_written_as_airflow_examples_write_it() -> None:
    start = pendulum.datetime(2021, 1, 1, tz="UTC")
    with DAG(
        "example",
        schedule="@daily",
        start_date=start,
        catchup=True,
        dagrun_timeout=pendulum.duration(minutes=60),
        default_args={
            "retry_delay": pendulum.duration(minutes=5),
            "execution_timeout": pendulum.duration(hours=1),
        },
    ) as dag:
        task = EmptyOperator(task_id="t")
    assert type(dag.start_date) is dt.datetime and dag.start_date == start
    assert type(dag.dagrun_timeout) is dt.timedelta and dag.dagrun_timeout.total_seconds() == 3600
    assert type(task.retry_delay) is dt.timedelta and task.retry_delay.total_seconds() == 300
    assert type(task.execution_timeout) is dt.timedelta
    first = runs(dag, dt.datetime(2021, 1, 3, tzinfo=dt.UTC), 1)[0]
    assert first.logical_date == dt.datetime(2021, 1, 1, tzinfo=dt.UTC)


def test_a_cron_schedule_runs_in_the_pendulum_start_dates_zone_across_dst() -> None:
    dag = DAG(
        "paris",
        schedule="0 12 * * *",
        start_date=pendulum.datetime(2024, 3, 29, tz="Europe/Paris"),
        catchup=True,
    )
    found = runs(dag, dt.datetime(2024, 4, 3, tzinfo=dt.UTC), 4)
    assert [info.logical_date.astimezone(PARIS).hour for info in found] == [12] * 4
    assert [info.logical_date.astimezone(PARIS).day for info in found] == [29, 30, 31, 1]


def test_a_duration_schedule_of_months_steps_by_calendar_month() -> None:
    dag = DAG(
        "monthly",
        schedule=pendulum.duration(months=1),
        start_date=pendulum.datetime(2024, 1, 15, tz="UTC"),
        catchup=True,
    )
    found = runs(dag, dt.datetime(2024, 6, 1, tzinfo=dt.UTC), 3)
    assert [info.logical_date.date() for info in found] == [
        dt.date(2024, 1, 15),
        dt.date(2024, 2, 15),
        dt.date(2024, 3, 15),
    ]


def test_a_duration_schedule_of_hours_is_a_timedelta_schedule() -> None:
    dag = DAG(
        "six_hourly",
        schedule=pendulum.duration(hours=6),
        start_date=pendulum.today("UTC").add(days=-1),
    )
    assert dag.schedule == dt.timedelta(hours=6)


def test_sensors_and_triggers_take_pendulum_values() -> None:
    target = pendulum.datetime(2030, 1, 1, 8, tz="America/New_York")
    sensor = DateTimeSensor(task_id="until", target_time=target)
    moment = sensor.target(make_context(sensor))
    assert type(moment) is dt.datetime and moment == target
    delta = TimeDeltaSensor(task_id="after", delta=pendulum.duration(hours=2))
    assert type(delta.delta) is dt.timedelta and delta.delta == dt.timedelta(hours=2)
    trigger = DateTimeTrigger(target)
    _, kwargs = trigger.serialize()
    restored: Any = serialization.loads(serialization.dumps(kwargs))["moment"]
    assert type(restored) is dt.datetime and restored == target
    assert restored.tzinfo == ZoneInfo("America/New_York")


def test_default_args_dates_in_pendulum_are_the_dags() -> None:
    """Airflow's tutorial: ``start_date`` in default_args, which every task then takes."""
    start = pendulum.datetime(2021, 1, 1, tz="Europe/Amsterdam")
    with DAG("tutorial", schedule="@daily", default_args={"start_date": start}) as dag:
        task = EmptyOperator(task_id="t")
    assert dag.start_date == start and type(dag.start_date) is dt.datetime
    assert task.start_date == dag.start_date  # type: ignore[attr-defined]
    assert dag.timezone == ZoneInfo("Europe/Amsterdam")
