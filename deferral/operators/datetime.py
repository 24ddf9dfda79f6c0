"""BranchDateTimeOperator (Airflow's ``airflow.operators.datetime``)."""

from __future__ import annotations

import datetime as dt
import warnings
from collections.abc import Iterable
from typing import Any

from deferral.context import Context
from deferral.exceptions import DagDefinitionError
from deferral.operators.branch import BaseBranchOperator

Bound = dt.datetime | dt.time | None


def target_times_as_dates(
    base: dt.datetime, lower: Bound, upper: Bound
) -> tuple[dt.datetime | None, dt.datetime | None]:
    """The bounds as date-times: a ``time`` falls on ``base``'s date, and an upper time earlier
    than the lower one on the day after (a window across midnight), as in Airflow."""
    if isinstance(lower, dt.datetime) and isinstance(upper, dt.datetime):
        return lower, upper
    low = dt.datetime.combine(base.date(), lower) if isinstance(lower, dt.time) else lower
    high = dt.datetime.combine(base.date(), upper) if isinstance(upper, dt.time) else upper
    if low is not None and high is not None and high < low:
        high += dt.timedelta(days=1)
    return low, high


class BranchDateTimeOperator(BaseBranchOperator):
    """Follows ``follow_task_ids_if_true`` when now (or the run's logical date, with
    ``use_task_logical_date=True``) lies within [``target_lower``, ``target_upper``], else
    ``follow_task_ids_if_false``. A bound is a date-time or a time of day (put on the UTC date
    compared, as Airflow does); naive bounds are read in the DAG's time zone; either bound may
    be None, not both."""

    def __init__(
        self,
        *,
        follow_task_ids_if_true: str | Iterable[str],
        follow_task_ids_if_false: str | Iterable[str],
        target_lower: Bound,
        target_upper: Bound,
        use_task_logical_date: bool = False,
        use_task_execution_date: bool = False,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        if target_lower is None and target_upper is None:
            raise DagDefinitionError(
                f"task {self.task_id!r}: target_lower and target_upper are both None: give at "
                "least one to compare the date-time with"
            )
        for name, bound in (("target_lower", target_lower), ("target_upper", target_upper)):
            if bound is not None and not isinstance(bound, dt.datetime | dt.time):
                raise DagDefinitionError(
                    f"task {self.task_id!r}: {name} must be a datetime, a time or None, "
                    f"got {type(bound).__name__}"
                )
        if use_task_execution_date:  # Airflow 2's deprecated name
            warnings.warn(
                "use_task_execution_date is deprecated (as in Airflow 2.2+): use "
                "use_task_logical_date",
                DeprecationWarning,
                stacklevel=3,
            )
            use_task_logical_date = True
        self.target_lower = target_lower
        self.target_upper = target_upper
        self.follow_task_ids_if_true = follow_task_ids_if_true
        self.follow_task_ids_if_false = follow_task_ids_if_false
        self.use_task_logical_date = use_task_logical_date

    def _aware(self, value: dt.datetime | None) -> dt.datetime | None:
        if value is None or value.utcoffset() is not None:
            return value
        assert self.dag is not None
        return value.replace(tzinfo=self.dag.timezone)

    def choose_branch(self, context: Context) -> str | Iterable[str]:
        now = context["logical_date"] if self.use_task_logical_date else dt.datetime.now(dt.UTC)
        lower, upper = target_times_as_dates(now, self.target_lower, self.target_upper)
        lower, upper = self._aware(lower), self._aware(upper)
        if (upper is not None and upper < now) or (lower is not None and lower > now):
            return self.follow_task_ids_if_false
        return self.follow_task_ids_if_true
