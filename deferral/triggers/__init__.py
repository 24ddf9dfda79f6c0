from deferral.triggers.base import BaseTrigger, TriggerEvent, TriggerProgress
from deferral.triggers.composite import AllOf, AnyOf
from deferral.triggers.file import FileTrigger
from deferral.triggers.http import HttpTrigger
from deferral.triggers.signal import CallbackTrigger, SignalTrigger
from deferral.triggers.task_end import (
    StartTriggerArgs,
    TaskFailedEvent,
    TaskSkippedEvent,
    TaskSuccessEvent,
)
from deferral.triggers.temporal import DateTimeTrigger, TimeDeltaTrigger

__all__ = [
    "AllOf",
    "AnyOf",
    "BaseTrigger",
    "CallbackTrigger",
    "DateTimeTrigger",
    "FileTrigger",
    "HttpTrigger",
    "SignalTrigger",
    "StartTriggerArgs",
    "TaskFailedEvent",
    "TaskSkippedEvent",
    "TaskSuccessEvent",
    "TimeDeltaTrigger",
    "TriggerEvent",
    "TriggerProgress",
]
