"""DayOfWeekSensor (Airflow's ``airflow.sensors.weekday``)."""

from __future__ import annotations

import datetime as dt
import warnings
from collections.abc import Iterable
from typing import Any

from deferral.context import Context
from deferral.exceptions import DagDefinitionError
from deferral.sensors.base import BaseSensorOperator
from deferral.utils.weekday import WeekDay


def week_day_numbers(task_id: str, week_day: str | WeekDay | Iterable[str | WeekDay]) -> set[int]:
    """The ISO numbers of a task's ``week_day`` argument; DagDefinitionError naming the task."""
    try:
        return WeekDay.validate_week_day(week_day)
    except (AttributeError, TypeError) as exc:
        raise DagDefinitionError(f"task {task_id!r}: week_day: {exc}") from None


class DayOfWeekSensor(BaseSensorOperator):
    """Waits until the day of the week is one of ``week_day`` (a day name in any case, a
    ``WeekDay``, or a collection of them): the run's logical date's day with
    ``use_task_logical_date=True``, else today's (UTC), as in Airflow."""

    def __init__(
        self,
        *,
        week_day: str | WeekDay | Iterable[str | WeekDay],
        use_task_logical_date: bool = False,
        use_task_execution_day: bool = False,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        if use_task_execution_day:  # Airflow 2's deprecated name
            warnings.warn(
                "use_task_execution_day is deprecated (as in Airflow 2.2+): use "
                "use_task_logical_date",
                DeprecationWarning,
                stacklevel=3,
            )
            use_task_logical_date = True
        self.week_day_numbers = week_day_numbers(self.task_id, week_day)
        self.week_day = week_day
        self.use_task_logical_date = use_task_logical_date

    def poke(self, context: Context) -> bool:
        day = context["logical_date"] if self.use_task_logical_date else dt.datetime.now(dt.UTC)
        return day.isoweekday() in self.week_day_numbers
