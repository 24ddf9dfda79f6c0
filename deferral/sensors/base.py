"""The base of every sensor (Airflow's ``airflow.sensors.base``), with Airflow 2.x's semantics.

``BaseSensorOperator`` pokes in the worker slot (mode ``poke``), frees the slot between pokes
(mode ``reschedule``: state up_for_reschedule until the next poke), or, with ``deferrable=True``,
pokes once and hands the rest of the wait to a trigger. The ``*Async`` sensors always defer.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import logging
import time
from collections.abc import Callable
from typing import Any, NoReturn

from deferral.baseoperator import BaseOperator
from deferral.context import Context
from deferral.exceptions import (
    DagDefinitionError,
    DeferralException,
    FailTask,
    RescheduleTask,
    SensorTimeout,
    SkipTask,
    TaskDeferralError,
    TaskDeferralTimeout,
    TaskExecutionTimeout,
)
from deferral.runtime.config import default_deferrable
from deferral.triggers import DateTimeTrigger
from deferral.triggers.base import BaseTrigger

log = logging.getLogger("deferral.sensors")

RESUME_METHOD = "execute_complete"
DEFAULT_TIMEOUT_SEC = 7 * 24 * 3600.0
# Exceptions from poke (or from a resumed deferral) that soft_fail turns into a skip.
_SOFT_FAILURES = (FailTask, TaskExecutionTimeout, TaskDeferralError)
# Largest backoff delay, as Airflow caps it: a timedelta must still hold it.
_MAX_DELAY_SEC = dt.timedelta.max.total_seconds() - 1


class PokeReturnValue:
    """What ``poke`` may return instead of a bool: ``is_done``, and ``xcom_value`` that the
    sensor returns (so it becomes its ``return_value`` XCom) once done."""

    def __init__(self, is_done: bool, xcom_value: Any | None = None) -> None:
        self.is_done = is_done
        self.xcom_value = xcom_value

    def __bool__(self) -> bool:
        return self.is_done


def _seconds(task_id: str, name: str, value: object) -> float:
    """A duration argument as seconds: a timedelta or a number, never negative."""
    if isinstance(value, dt.timedelta):
        seconds = value.total_seconds()
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        seconds = float(value)
    else:
        raise DagDefinitionError(
            f"task {task_id!r}: {name} must be a timedelta or a number of seconds, "
            f"got {type(value).__name__}"
        )
    if seconds < 0:
        raise DagDefinitionError(f"task {task_id!r}: {name} must not be negative, got {value!r}")
    return seconds


def _done_value(result: bool | PokeReturnValue) -> Any:
    return result.xcom_value if isinstance(result, PokeReturnValue) else None


class BaseSensorOperator(BaseOperator):
    """Subclass and implement ``poke(context) -> bool | PokeReturnValue``.

    ``timeout`` counts from the try's first poke (across reschedules and deferrals); when it
    passes the task fails with SensorTimeout, never retried, or is skipped with ``soft_fail``.
    ``soft_fail`` also skips on FailTask / SensorTimeout / execution timeouts raised in ``poke``
    and on a failed deferral; ``silent_fail`` treats any other poke error as "not yet";
    ``never_fail`` skips on any poke error.
    """

    valid_modes = ("poke", "reschedule")

    def __init__(
        self,
        *,
        poke_interval: dt.timedelta | float = 60,
        timeout: dt.timedelta | float = DEFAULT_TIMEOUT_SEC,
        soft_fail: bool = False,
        mode: str = "poke",
        exponential_backoff: bool = False,
        max_wait: dt.timedelta | float | None = None,
        silent_fail: bool = False,
        never_fail: bool = False,
        deferrable: bool | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        if mode not in self.valid_modes:
            raise DagDefinitionError(
                f"task {self.task_id!r}: sensor mode {mode!r} is not 'poke' or 'reschedule'"
            )
        if soft_fail and never_fail:
            raise DagDefinitionError(
                f"task {self.task_id!r}: soft_fail and never_fail exclude each other"
            )
        self.poke_interval = _seconds(self.task_id, "poke_interval", poke_interval)
        self.timeout = _seconds(self.task_id, "timeout", timeout)
        self.max_wait = (
            None
            if max_wait is None
            else dt.timedelta(seconds=_seconds(self.task_id, "max_wait", max_wait))
        )
        self.soft_fail = soft_fail
        self.silent_fail = silent_fail
        self.never_fail = never_fail
        self.mode = mode
        self.exponential_backoff = exponential_backoff
        self.deferrable = default_deferrable() if deferrable is None else deferrable

    @property
    def reschedule(self) -> bool:
        return self.mode == "reschedule"

    def poke(self, context: Context) -> bool | PokeReturnValue:
        raise NotImplementedError(f"{type(self).__name__} must implement poke()")

    # -- poke and reschedule modes -----------------------------------------------------------

    def execute(self, context: Context) -> Any:
        started_at: dt.datetime | float
        if self.reschedule:
            # Reschedule mode: one poke per run of the task, timed from the try's first poke.
            first_poke = context["ti"].first_started_at
            started_at = first_poke

            def run_duration() -> float:
                return (dt.datetime.now(dt.UTC) - first_poke).total_seconds()

        else:
            started_at = start = time.monotonic()

            def run_duration() -> float:
                return time.monotonic() - start

        poke_count = 1
        while not (result := self._poke(context)):
            if run_duration() > self.timeout:
                self._timed_out(run_duration())
            interval = self._next_poke_interval(started_at, run_duration(), poke_count)
            if self.reschedule:
                raise RescheduleTask(dt.datetime.now(dt.UTC) + dt.timedelta(seconds=interval))
            time.sleep(interval)
            poke_count += 1
        return _done_value(result)

    def _poke(self, context: Context) -> bool | PokeReturnValue:
        """``poke`` with Airflow's failure handling (soft_fail, silent_fail, never_fail)."""
        try:
            return self.poke(context)
        except _SOFT_FAILURES as exc:
            if self.soft_fail or self.never_fail:
                flag = "soft_fail" if self.soft_fail else "never_fail"
                raise SkipTask(f"skipped ({flag}): {type(exc).__name__}: {exc}") from exc
            raise
        except DeferralException:
            raise  # skip, defer, reschedule: the sensor's own way out, not a failure
        except Exception as exc:
            if self.silent_fail:
                log.error("sensor %r: poke failed, poking again later", self.task_id, exc_info=True)
                return False
            if self.never_fail:
                raise SkipTask(f"skipped (never_fail): {type(exc).__name__}: {exc}") from exc
            raise

    def _timed_out(self, waited: float) -> NoReturn:
        message = (
            f"sensor {self.task_id!r} timed out: waited {waited:.1f}s, "
            f"longer than its timeout of {self.timeout:g}s"
        )
        if self.soft_fail:
            raise SkipTask(message)
        raise SensorTimeout(message)

    def _next_poke_interval(
        self, started_at: dt.datetime | float, run_duration: float, poke_count: int
    ) -> float:
        """Seconds until the next poke: ``poke_interval``, or with ``exponential_backoff``
        Airflow's jittered doubling (about ``poke_interval * 2**(n-2)`` for the n-th poke),
        never past the timeout nor ``max_wait``. In reschedule mode each poke is a new run of
        the task, so n is estimated from the time waited since the first poke."""
        if not self.exponential_backoff:
            return self.poke_interval
        if self.reschedule:
            poke_count, waited = 0, 0.0
            while waited <= run_duration:
                poke_count += 1
                waited += self._backoff(started_at, poke_count)
        interval = min(self._backoff(started_at, poke_count), self.timeout - int(run_duration))
        if self.max_wait:
            interval = min(interval, self.max_wait.total_seconds())
        return interval

    def _backoff(self, started_at: dt.datetime | float, poke_count: int) -> float:
        """The n-th backoff delay, in [base, 2 * base) with base = poke_interval * 2**(n-2) (at
        least 1 s); the jitter comes from a hash of the task and the wait, so that sensors that
        started together do not poke together, yet every replica computes the same delay."""
        base = max(int(self.poke_interval * 2 ** (poke_count - 2)), 1)
        dag_id = self.dag.dag_id if self.dag is not None else ""
        key = f"{dag_id}#{self.task_id}#{started_at}#{poke_count}"
        jitter = int(hashlib.sha1(key.encode(), usedforsecurity=False).hexdigest(), 16) % base
        return min(base + jitter, _MAX_DELAY_SEC)

    # -- deferrable mode ---------------------------------------------------------------------

    def poke_then_defer(self, context: Context, trigger: Callable[[], BaseTrigger]) -> Any:
        """Deferrable mode: poke once, return at once if already satisfied, else hand the wait
        to ``trigger()`` for at most ``timeout``, resuming at ``execute_complete``."""
        if result := self._poke(context):
            return _done_value(result)
        self.defer(
            trigger=trigger(),
            method_name=RESUME_METHOD,
            timeout=dt.timedelta(seconds=self.timeout),
        )

    def resume_execution(
        self, next_method: str, next_kwargs: dict[str, Any] | None, context: Context
    ) -> Any:
        """A deferral that timed out is the sensor's timeout: SensorTimeout (never retried),
        or skipped with ``soft_fail``, as is any other failure of the resumed wait."""
        try:
            return super().resume_execution(next_method, next_kwargs, context)
        except TaskDeferralTimeout as exc:
            message = f"sensor {self.task_id!r} timed out: {exc}"
            if self.soft_fail:
                raise SkipTask(message) from exc
            raise SensorTimeout(message) from exc
        except _SOFT_FAILURES as exc:
            if self.soft_fail:
                raise SkipTask(f"skipped (soft_fail): {type(exc).__name__}: {exc}") from exc
            raise

    def execute_complete(self, context: Context, event: Any = None) -> None:
        return None


class MomentSensor(BaseSensorOperator):
    """Waits until ``target(context)``; deferrable through a DateTimeTrigger."""

    def target(self, context: Context) -> dt.datetime:
        raise NotImplementedError

    def poke(self, context: Context) -> bool:
        return dt.datetime.now(dt.UTC) >= self.target(context)

    def execute(self, context: Context) -> Any:
        if self.deferrable:
            return self.poke_then_defer(context, lambda: DateTimeTrigger(self.target(context)))
        return super().execute(context)
