"""Windows of time as Airflow 3.3's (``airflow.partition_mappers.window``), pure: their members
forward and backward, an ``HourWindow`` rollup waiting for the 60 minutes of its hour, and
fan-outs over time windows making one downstream key per member, formatted as Airflow's."""

from __future__ import annotations

import datetime as dt

import pytest

from deferral.partitions import (
    DayWindow,
    FanOutMapper,
    HourWindow,
    IdentityMapper,
    MinimumCount,
    MonthWindow,
    PartitionError,
    QuarterWindow,
    RollupMapper,
    StartOfDayMapper,
    StartOfHourMapper,
    StartOfMonthMapper,
    StartOfQuarterMapper,
    StartOfWeekMapper,
    StartOfYearMapper,
    WeekWindow,
    Window,
    YearWindow,
)

BACKWARD = Window.Direction.BACKWARD
START = dt.datetime(2024, 3, 1)


@pytest.mark.parametrize(
    ("window", "count", "first", "last"),
    [
        (HourWindow(), 60, START, START + dt.timedelta(minutes=59)),
        (HourWindow(direction=BACKWARD), 60, START - dt.timedelta(minutes=59), START),
        (DayWindow(), 24, START, START + dt.timedelta(hours=23)),
        (WeekWindow(direction=BACKWARD), 7, dt.datetime(2024, 2, 24), START),
        (MonthWindow(), 31, START, dt.datetime(2024, 3, 31)),
        # Airflow's trailing month: the days after Feb 1 up to and including Mar 1.
        (MonthWindow(direction=BACKWARD), 29, dt.datetime(2024, 2, 2), START),
        (QuarterWindow(), 3, START, dt.datetime(2024, 5, 1)),
        (YearWindow(direction=BACKWARD), 12, dt.datetime(2023, 4, 1), START),
    ],
)
def test_a_window_has_airflows_members(
    window: Window, count: int, first: dt.datetime, last: dt.datetime
) -> None:
    members = window.members(START)
    assert (len(members), members[0], members[-1]) == (count, first, last)


def test_a_month_stepped_window_needs_a_period_starting_on_day_one() -> None:
    with pytest.raises(ValueError, match=r"^QuarterWindow expects a period start on day 1"):
        QuarterWindow().members(dt.datetime(2024, 3, 13))


def test_an_hour_window_rollup_waits_for_the_sixty_minutes_of_its_hour() -> None:
    hourly = RollupMapper(
        upstream_mapper=StartOfHourMapper(input_format="%Y-%m-%dT%H:%M"), window=HourWindow()
    )
    assert hourly.to_downstream("2024-03-13T10:42") == "2024-03-13T10"
    minutes = {f"2024-03-13T10:{m:02d}" for m in range(60)}
    assert hourly.to_upstream("2024-03-13T10") == minutes
    assert hourly.complete("2024-03-13T10", minutes)
    assert not hourly.complete("2024-03-13T10", minutes - {"2024-03-13T10:59"})
    most = RollupMapper(
        upstream_mapper=StartOfHourMapper(input_format="%Y-%m-%dT%H:%M"),
        window=HourWindow(),
        wait_policy=MinimumCount(-5),
    )
    assert most.complete("2024-03-13T10", set(sorted(minutes)[:55]))


def test_a_day_rollup_expects_the_producers_own_key_format_in_its_timezone() -> None:
    daily = RollupMapper(
        upstream_mapper=StartOfDayMapper(timezone="Asia/Tokyo"), window=DayWindow()
    )
    expected = daily.to_upstream("2024-03-13")
    assert min(expected) == "2024-03-13T00:00:00" and max(expected) == "2024-03-13T23:00:00"


@pytest.mark.parametrize(
    ("mapper", "key", "keys"),
    [
        # A week's key (ISO week in it) fans out into its 7 days, as Airflow's example does.
        (
            FanOutMapper(upstream_mapper=StartOfWeekMapper(), window=WeekWindow()),
            "2024-03-13T10:00:00",
            [f"2024-03-{d}" for d in range(11, 18)],
        ),
        (
            FanOutMapper(
                upstream_mapper=StartOfWeekMapper(), window=WeekWindow(direction=BACKWARD)
            ),
            "2024-03-13T10:00:00",
            [f"2024-03-{d:02d}" for d in range(5, 12)],
        ),
        (
            FanOutMapper(upstream_mapper=StartOfDayMapper(), window=DayWindow()),
            "2024-03-13T10:00:00",
            [f"2024-03-13T{h:02d}" for h in range(24)],
        ),
        (
            FanOutMapper(upstream_mapper=StartOfQuarterMapper(), window=QuarterWindow()),
            "2024-05-20T00:00:00",
            ["2024-04", "2024-05", "2024-06"],
        ),
        (
            FanOutMapper(upstream_mapper=StartOfYearMapper(), window=YearWindow()),
            "2024-05-20T00:00:00",
            [f"2024-{m:02d}" for m in range(1, 13)],
        ),
        (
            FanOutMapper(
                upstream_mapper=StartOfMonthMapper(input_format="%Y-%m-%d"), window=MonthWindow()
            ),
            "2024-02-10",
            [f"2024-02-{d:02d}" for d in range(1, 30)],
        ),
        # No default downstream mapper for an hour: given one, each minute is its key.
        (
            FanOutMapper(
                upstream_mapper=StartOfHourMapper(),
                window=HourWindow(),
                downstream_mapper=StartOfHourMapper(output_format="%H:%M"),
            ),
            "2024-03-13T10:42:00",
            [f"10:{m:02d}" for m in range(60)],
        ),
        # A downstream mapper that is not of time: ISO timestamps, as Airflow's _format_with.
        (
            FanOutMapper(
                upstream_mapper=StartOfQuarterMapper(),
                window=QuarterWindow(),
                downstream_mapper=IdentityMapper(),
            ),
            "2024-05-20T00:00:00",
            ["2024-04-01T00:00:00", "2024-05-01T00:00:00", "2024-06-01T00:00:00"],
        ),
    ],
)
def test_a_fan_out_over_a_time_window_makes_a_key_per_member(
    mapper: FanOutMapper, key: str, keys: list[str]
) -> None:
    assert mapper.to_downstream(key) == keys


def test_a_fan_out_over_more_keys_than_its_cap_makes_none() -> None:
    capped = FanOutMapper(
        upstream_mapper=StartOfDayMapper(), window=DayWindow(), max_downstream_keys=7
    )
    with pytest.raises(ValueError, match=r"^partition fan-out of 24 keys exceeds 7$"):
        capped.to_downstream("2024-03-13T10:00:00")


@pytest.mark.parametrize("kind", [RollupMapper, FanOutMapper])
def test_a_time_window_over_keys_not_read_as_times_is_refused_naming_it(kind: type) -> None:
    with pytest.raises(PartitionError) as refused:
        kind(upstream_mapper=IdentityMapper(), window=DayWindow())
    assert str(refused.value) == (
        f"{kind.__name__}: a DayWindow needs a StartOf...Mapper upstream_mapper (it reads keys"
        " as times), got IdentityMapper"
    )
