from deferral.triggers.approval import ApprovalTrigger
from deferral.triggers.asset_event import AssetEventTrigger
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
    "ApprovalTrigger",
    "AssetEventTrigger",
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
