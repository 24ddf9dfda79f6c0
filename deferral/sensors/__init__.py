"""Sensors: tasks that wait for a condition, with Airflow 2.x's semantics.

``BaseSensorOperator`` pokes in the worker slot (mode ``poke``), frees the slot between pokes
(mode ``reschedule``: state up_for_reschedule until the next poke), or, with ``deferrable=True``,
pokes once and hands the rest of the wait to a trigger. The ``*Async`` sensors always defer.

Each sensor lives in the module of Airflow's path (``deferral.sensors.time_delta``,
``.date_time``, ``.filesystem``, ``.bash``, ``.python``, ``.time_sensor``, ``.weekday``,
``.base``, ``.external_task``) and is importable from here too.
"""

from deferral.sensors.base import (
    DEFAULT_TIMEOUT_SEC,
    RESUME_METHOD,
    BaseSensorOperator,
    MomentSensor,
    PokeReturnValue,
)
from deferral.sensors.bash import BashSensor
from deferral.sensors.date_time import DateTimeSensor, DateTimeSensorAsync
from deferral.sensors.external_task import ExternalTaskMarker, ExternalTaskSensor
from deferral.sensors.filesystem import FileSensor
from deferral.sensors.python import PythonSensor
from deferral.sensors.time_delta import TimeDeltaSensor, TimeDeltaSensorAsync
from deferral.sensors.time_sensor import TimeSensor, TimeSensorAsync
from deferral.sensors.weekday import DayOfWeekSensor

__all__ = [
    "DEFAULT_TIMEOUT_SEC",
    "RESUME_METHOD",
    "BaseSensorOperator",
    "BashSensor",
    "DateTimeSensor",
    "DateTimeSensorAsync",
    "DayOfWeekSensor",
    "ExternalTaskMarker",
    "ExternalTaskSensor",
    "FileSensor",
    "MomentSensor",
    "PokeReturnValue",
    "PythonSensor",
    "TimeDeltaSensor",
    "TimeDeltaSensorAsync",
    "TimeSensor",
    "TimeSensorAsync",
]
