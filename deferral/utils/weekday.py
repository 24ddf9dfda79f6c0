"""WeekDay (Airflow's ``airflow.utils.weekday``): ISO day numbers, Monday = 1 ... Sunday = 7."""

from __future__ import annotations

import enum
from collections.abc import Iterable


class WeekDay(enum.IntEnum):
    MONDAY = 1
    TUESDAY = 2
    WEDNESDAY = 3
    THURSDAY = 4
    FRIDAY = 5
    SATURDAY = 6
    SUNDAY = 7

    @classmethod
    def get_weekday_number(cls, week_day_str: str) -> int:
        """The ISO number of a day named in any case (``"monday"``, ``"Monday"``)."""
        try:
            return cls[week_day_str.upper()].value
        except KeyError:
            raise AttributeError(f'invalid week day name "{week_day_str}"') from None

    @classmethod
    def convert(cls, day: str | WeekDay) -> int:
        if isinstance(day, WeekDay):
            return day.value
        if isinstance(day, str):
            return cls.get_weekday_number(day)
        raise TypeError(f"a week day must be a str or a WeekDay, got {type(day).__name__}")

    @classmethod
    def validate_week_day(cls, week_day: str | WeekDay | Iterable[str | WeekDay]) -> set[int]:
        """The ISO numbers of one day or a collection of days, each named or a WeekDay."""
        if isinstance(week_day, str | WeekDay):
            return {cls.convert(week_day)}
        if isinstance(week_day, Iterable):
            return {cls.convert(day) for day in week_day}
        raise TypeError(
            "week_day must be a day name, a WeekDay, or a collection of them, "
            f"got {type(week_day).__name__}"
        )
