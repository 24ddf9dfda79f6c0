"""BranchDayOfWeekOperator (Airflow's ``airflow.operators.weekday``)."""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable
from typing import Any

from deferral.context import Context
from deferral.operators.branch import BaseBranchOperator
from deferral.sensors.weekday import week_day_numbers
from deferral.utils.weekday import WeekDay


class BranchDayOfWeekOperator(BaseBranchOperator):
    """Follows ``follow_task_ids_if_true`` when the day is one of ``week_day`` (a day name in
    any case, a ``WeekDay``, or a collection of them), else ``follow_task_ids_if_false``: the
    day of the run's logical date with ``use_task_logical_date=True``, else today's in the DAG's
    time zone, as in Airflow."""

    def __init__(
        self,
        *,
        follow_task_ids_if_true: str | Iterable[str],
        follow_task_ids_if_false: str | Iterable[str],
        week_day: str | WeekDay | Iterable[str | WeekDay],
        use_task_logical_date: bool = False,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.week_day_numbers = week_day_numbers(self.task_id, week_day)
        self.follow_task_ids_if_true = follow_task_ids_if_true
        self.follow_task_ids_if_false = follow_task_ids_if_false
        self.week_day = week_day
        self.use_task_logical_date = use_task_logical_date

    def choose_branch(self, context: Context) -> str | Iterable[str]:
        if self.use_task_logical_date:
            day = context["logical_date"]
        else:
            assert self.dag is not None
            day = dt.datetime.now(self.dag.timezone)
        if day.isoweekday() in self.week_day_numbers:
            return self.follow_task_ids_if_true
        return self.follow_task_ids_if_false
