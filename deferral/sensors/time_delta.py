"""TimeDeltaSensor and its deferrable twin (Airflow's ``airflow.sensors.time_delta``)."""

from __future__ import annotations

import datetime as dt
from typing import Any

from deferral.context import Context
from deferral.exceptions import DagDefinitionError
from deferral.sensors.base import MomentSensor
from deferral.timezone import standard_timedelta


class TimeDeltaSensor(MomentSensor):
    """Waits until the run's logical date + ``delta``."""

    def __init__(self, *, delta: dt.timedelta, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if not isinstance(delta, dt.timedelta):
            raise DagDefinitionError(
                f"task {self.task_id!r}: delta must be a timedelta, got {type(delta).__name__}"
            )
        self.delta = standard_timedelta(delta)

    def target(self, context: Context) -> dt.datetime:
        return context["logical_date"] + self.delta


class TimeDeltaSensorAsync(TimeDeltaSensor):
    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**{**kwargs, "deferrable": True})
