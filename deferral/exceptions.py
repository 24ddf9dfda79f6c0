"""Exceptions that task code raises, or that the runtime raises into task code."""

from __future__ import annotations

import datetime as dt
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from deferral.triggers.base import BaseTrigger


class DeferralException(Exception):
    """Base of every exception of this package."""


class TaskDeferred(DeferralException):
    """Raised (by ``BaseOperator.defer`` or by user code) to hand the wait to a trigger."""

    def __init__(
        self,
        *,
        trigger: BaseTrigger,
        method_name: str,
        kwargs: dict[str, Any] | None = None,
        timeout: dt.timedelta | None = None,
    ) -> None:
        super().__init__(trigger, method_name, kwargs, timeout)
        self.trigger = trigger
        self.method_name = method_name
        self.kwargs = kwargs or {}
        self.timeout = timeout

    def __str__(self) -> str:
        return f"deferred to {type(self.trigger).__name__}, resuming at {self.method_name}()"


class TaskDeferralError(DeferralException):
    """The trigger the task waited on failed; the message carries its traceback."""


class TaskDeferralTimeout(DeferralException):
    """The deferral's timeout (or the task's execution_timeout) passed before the trigger fired."""


class SkipTask(DeferralException):
    """Ends the task in state skipped."""


class FailTask(DeferralException):
    """Fails the task without retrying it."""


class SensorTimeout(FailTask):
    """A sensor waited longer than its timeout."""


class TaskExecutionTimeout(DeferralException):
    """The task ran past its execution_timeout (counted from its try's first start)."""


class RescheduleTask(DeferralException):
    """Frees the worker slot and runs the task again at ``reschedule_date`` (same try): what a
    sensor in ``mode="reschedule"`` raises when its poke says "not yet"."""

    def __init__(self, reschedule_date: dt.datetime) -> None:
        super().__init__(reschedule_date)
        self.reschedule_date = reschedule_date
