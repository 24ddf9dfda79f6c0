from deferral.triggers.base import BaseTrigger, TriggerEvent
from deferral.triggers.file import FileTrigger
from deferral.triggers.http import HttpTrigger
from deferral.triggers.task_end import (
    StartTriggerArgs,
    TaskFailedEvent,
    TaskSkippedEvent,
    TaskSuccessEvent,
)
from deferral.triggers.temporal import DateTimeTrigger, TimeDeltaTrigger

__all__ = [
    "BaseTrigger",
    "DateTimeTrigger",
    "FileTrigger",
    "HttpTrigger",
    "StartTriggerArgs",
    "TaskFailedEvent",
    "TaskSkippedEvent",
    "TaskSuccessEvent",
    "TimeDeltaTrigger",
    "TriggerEvent",
]
