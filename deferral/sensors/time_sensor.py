"""TimeSensor and TimeSensorAsync (Airflow's ``airflow.sensors.time_sensor``): wait until a
time of day in the DAG's time zone."""

from __future__ import annotations

import datetime as dt
from typing import Any

from deferral.context import Context
from deferral.exceptions import DagDefinitionError
from deferral.sensors.base import MomentSensor


class TimeSensor(MomentSensor):
    """Waits until ``target_time`` (a ``datetime.time``) of the day the poke runs on, in the
    DAG's time zone. Deferrable with ``deferrable=True``."""

    def __init__(self, *, target_time: dt.time, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if not isinstance(target_time, dt.time):
            raise DagDefinitionError(
                f"task {self.task_id!r}: target_time must be a datetime.time, "
                f"got {type(target_time).__name__}"
            )
        self.target_time = target_time

    def target(self, context: Context) -> dt.datetime:
        # Computed when the task runs (Airflow 2.10's TimeSensorAsync fixes the day at parse
        # time, so a DAG parsed yesterday waits for yesterday's time).
        zone = self.dag.timezone if self.dag is not None else dt.UTC
        today = dt.datetime.now(zone).date()
        if self.target_time.tzinfo is not None:
            return dt.datetime.combine(today, self.target_time)
        return dt.datetime.combine(today, self.target_time, tzinfo=zone)


class TimeSensorAsync(TimeSensor):
    """TimeSensor that always defers: the wait holds no worker slot."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**{**kwargs, "deferrable": True})
