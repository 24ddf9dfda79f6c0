"""DateTimeSensor and its deferrable twin (Airflow's ``airflow.sensors.date_time``)."""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from typing import Any

from deferral.context import Context
from deferral.exceptions import DagDefinitionError, FailTask
from deferral.sensors.base import MomentSensor
from deferral.timezone import make_aware


class DateTimeSensor(MomentSensor):
    """Waits until ``target_time``: a datetime (a naive one is read in
    ``DEFERRAL_DEFAULT_TIMEZONE``) or an ISO 8601 string (e.g. rendered from a template)."""

    template_fields: Sequence[str] = ("target_time",)

    def __init__(self, *, target_time: dt.datetime | str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if isinstance(target_time, dt.datetime):
            self.target_time: dt.datetime | str = make_aware(target_time)
        elif isinstance(target_time, str):
            self.target_time = target_time
        else:
            raise DagDefinitionError(
                f"task {self.task_id!r}: target_time must be a datetime or an ISO 8601 str, "
                f"got {type(target_time).__name__}"
            )

    def target(self, context: Context) -> dt.datetime:
        if isinstance(self.target_time, dt.datetime):
            return self.target_time
        try:
            return make_aware(dt.datetime.fromisoformat(self.target_time))
        except ValueError:
            raise FailTask(
                f"task {self.task_id!r}: target_time {self.target_time!r} is not an ISO 8601 "
                "datetime"
            ) from None


class DateTimeSensorAsync(DateTimeSensor):
    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**{**kwargs, "deferrable": True})
