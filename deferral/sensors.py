"""Sensors: tasks that wait for a condition.

``BaseSensorOperator`` pokes in the worker slot (mode ``poke``), frees the slot between pokes
(mode ``reschedule``: state up_for_reschedule until the next poke), or, with ``deferrable=True``,
hands the wait to a trigger. The ``*Async`` sensors always defer.
"""

from __future__ import annotations

import datetime as dt
import os
import time
from typing import Any

from deferral.baseoperator import BaseOperator
from deferral.config import default_deferrable
from deferral.context import Context
from deferral.dag import DagDefinitionError
from deferral.exceptions import RescheduleTask, SensorTimeout, SkipTask
from deferral.triggers import DateTimeTrigger, FileTrigger

RESUME_METHOD = "execute_complete"


class BaseSensorOperator(BaseOperator):
    def __init__(
        self,
        *,
        poke_interval: float = 60,
        timeout: float = 7 * 24 * 3600,
        soft_fail: bool = False,
        mode: str = "poke",
        exponential_backoff: bool = False,
        max_wait: float | None = None,
        deferrable: bool | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        if mode not in ("poke", "reschedule"):
            raise DagDefinitionError(
                f"task {self.task_id!r}: sensor mode {mode!r} is not 'poke' or 'reschedule'"
            )
        self.poke_interval = float(poke_interval)
        self.timeout = float(timeout)
        self.soft_fail = soft_fail
        self.mode = mode
        self.exponential_backoff = exponential_backoff
        self.max_wait = max_wait
        self.deferrable = default_deferrable() if deferrable is None else deferrable

    def poke(self, context: Context) -> bool:
        raise NotImplementedError(f"{type(self).__name__} must implement poke()")

    def execute(self, context: Context) -> Any:
        if self.mode == "reschedule":
            return self._poke_or_reschedule(context)
        started = time.monotonic()
        interval = self.poke_interval
        while not self.poke(context):
            if time.monotonic() - started > self.timeout:
                self._timed_out()
            time.sleep(interval)
            if self.exponential_backoff:
                interval = min(interval * 2, self.max_wait or float("inf"))
        return None

    def _poke_or_reschedule(self, context: Context) -> None:
        """One poke; "not yet" frees the slot until the next poke (state up_for_reschedule).
        The timeout counts from the try's first poke, across reschedules."""
        if self.poke(context):
            return None
        now = dt.datetime.now(dt.UTC)
        if (now - context["ti"].first_started_at).total_seconds() > self.timeout:
            self._timed_out()
        raise RescheduleTask(now + dt.timedelta(seconds=self.poke_interval))

    def _timed_out(self) -> None:
        message = f"sensor {self.task_id!r} timed out after {self.timeout:g}s"
        if self.soft_fail:
            raise SkipTask(message)
        raise SensorTimeout(message)

    def execute_complete(self, context: Context, event: Any = None) -> None:
        return None


class DateTimeSensor(BaseSensorOperator):
    """Waits until ``target_time`` (tz-aware)."""

    def __init__(self, *, target_time: dt.datetime, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if target_time.tzinfo is None:
            raise DagDefinitionError(f"task {self.task_id!r}: target_time must be tz-aware")
        self.target_time = target_time

    def target(self, context: Context) -> dt.datetime:
        return self.target_time

    def poke(self, context: Context) -> bool:
        return dt.datetime.now(dt.UTC) >= self.target(context)

    def execute(self, context: Context) -> Any:
        if self.deferrable:
            self.defer(
                trigger=DateTimeTrigger(self.target(context)),
                method_name=RESUME_METHOD,
                timeout=dt.timedelta(seconds=self.timeout),
            )
        return super().execute(context)


class TimeDeltaSensor(DateTimeSensor):
    """Waits until the run's logical date + ``delta``."""

    def __init__(self, *, delta: dt.timedelta, **kwargs: Any) -> None:
        # target_time is computed per run from the logical date; epoch is a placeholder.
        super().__init__(target_time=dt.datetime.fromtimestamp(0, dt.UTC), **kwargs)
        self.delta = delta

    def target(self, context: Context) -> dt.datetime:
        return context["logical_date"] + self.delta


class DateTimeSensorAsync(DateTimeSensor):
    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**{**kwargs, "deferrable": True})


class TimeDeltaSensorAsync(TimeDeltaSensor):
    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**{**kwargs, "deferrable": True})


class FileSensor(BaseSensorOperator):
    """Waits for ``filepath`` to exist."""

    def __init__(self, *, filepath: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.filepath = filepath

    def poke(self, context: Context) -> bool:
        return os.path.exists(self.filepath)

    def execute(self, context: Context) -> Any:
        if self.deferrable:
            self.defer(
                trigger=FileTrigger(self.filepath, poll_interval=self.poke_interval),
                method_name=RESUME_METHOD,
                timeout=dt.timedelta(seconds=self.timeout),
            )
        return super().execute(context)
