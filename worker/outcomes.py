"""What one task attempt ended with, as the child process reports it to the worker.

Values are already in serialization.to_jsonable form: a value that cannot be carried was refused
in the child, where the error can name the key and the type.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class AttemptRequest:
    task_instance_id: int
    dag_id: str
    run_id: str
    task_id: str
    map_index: int
    try_number: int
    logical_date: dt.datetime
    conf: dict[str, Any]
    first_started_at: dt.datetime
    next_method: str | None
    next_kwargs: dict[str, Any] | None


@dataclass(frozen=True)
class Succeeded:
    return_value: Any


@dataclass(frozen=True)
class Skipped:
    reason: str


@dataclass(frozen=True)
class Failed:
    error: str  # one line
    traceback: str
    allow_retry: bool


@dataclass(frozen=True)
class Deferred:
    classpath: str
    trigger_kwargs: dict[str, Any]
    method_name: str
    next_kwargs: dict[str, Any]
    trigger_timeout: dt.datetime | None


@dataclass(frozen=True)
class Rescheduled:
    reschedule_date: dt.datetime


Outcome = Succeeded | Skipped | Failed | Deferred | Rescheduled
