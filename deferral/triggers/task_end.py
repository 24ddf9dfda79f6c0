"""Start and end a task in the triggerer (Airflow 2.10's ``start_from_trigger`` and
``end_from_trigger``): :class:`StartTriggerArgs` says which trigger a task defers to before any
worker runs it; a trigger that yields a :class:`TaskSuccessEvent`, :class:`TaskFailedEvent` or
:class:`TaskSkippedEvent` ends its task there, with the XComs it carries, no worker needed."""

from __future__ import annotations

import datetime as dt
import importlib
from dataclasses import dataclass
from typing import Any, ClassVar

from deferral.states import END_KINDS, TaskState
from deferral.triggers.base import BaseTrigger, TriggerEvent

# Bounds on what a task-end event may carry (it becomes XCom rows).
MAX_END_XCOMS = 100
MAX_XCOM_KEY = 512


@dataclass
class StartTriggerArgs:
    """What a task with ``start_from_trigger = True`` defers to as soon as it is scheduled, as
    Airflow's (same names and field order): the trigger's classpath and kwargs, the method and
    kwargs it resumes at, and how long it may wait."""

    trigger_cls: str
    next_method: str
    trigger_kwargs: dict[str, Any] | None = None
    next_kwargs: dict[str, Any] | None = None
    timeout: dt.timedelta | None = None


def start_trigger(args: StartTriggerArgs) -> BaseTrigger:
    """The trigger ``args`` name, built from its kwargs; TypeError if ``trigger_cls`` does not
    name a BaseTrigger class."""
    module, _, name = args.trigger_cls.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), name, None) if module else None
    except ImportError as exc:
        raise TypeError(f"start_trigger_args.trigger_cls {args.trigger_cls!r}: {exc}") from None
    if not (isinstance(cls, type) and issubclass(cls, BaseTrigger)):
        raise TypeError(
            f"start_trigger_args.trigger_cls {args.trigger_cls!r} is not a BaseTrigger class"
        )
    return cls(**(args.trigger_kwargs or {}))


class BaseTaskEndEvent(TriggerEvent):
    """An event that ends its task in the state it names; ``xcoms`` (key -> JSON-able value)
    are pushed as the task's XComs."""

    task_instance_state: ClassVar[TaskState]

    def __init__(self, *, xcoms: dict[str, Any] | None = None) -> None:
        super().__init__({"xcoms": dict(xcoms or {})})
        self.xcoms = dict(xcoms or {})

    def __repr__(self) -> str:
        return f"{type(self).__name__}(xcoms={self.xcoms!r})"


class TaskSuccessEvent(BaseTaskEndEvent):
    """The task succeeds."""

    task_instance_state = TaskState.SUCCESS


class TaskFailedEvent(BaseTaskEndEvent):
    """The task fails: up_for_retry while it has tries left, else failed (callbacks run)."""

    task_instance_state = TaskState.FAILED


class TaskSkippedEvent(BaseTaskEndEvent):
    """The task is skipped."""

    task_instance_state = TaskState.SKIPPED


def end_kind(event: TriggerEvent) -> str | None:
    """The event kind of a task-end event; None for any other event."""
    if isinstance(event, BaseTaskEndEvent):
        return END_KINDS[event.task_instance_state]
    return None


def check_end_xcoms(payload: Any) -> dict[str, Any]:
    """The XComs a task-end event's payload carries; ValueError saying what is wrong."""
    xcoms = payload.get("xcoms") if isinstance(payload, dict) else None
    if not isinstance(xcoms, dict):
        raise ValueError("a task-end event's payload must be {'xcoms': {key: value}}")
    if len(xcoms) > MAX_END_XCOMS:
        raise ValueError(f"a task-end event carries more than {MAX_END_XCOMS} XComs")
    for key in xcoms:
        if not isinstance(key, str) or not 0 < len(key) <= MAX_XCOM_KEY:
            raise ValueError(f"XCom key {str(key)[:40]!r} must be a string of 1..{MAX_XCOM_KEY}")
    return xcoms
