"""What one task attempt ended with, as the child process reports it to the worker.

Values are already in serialization.to_jsonable form: a value that cannot be carried was refused
in the child, where the error can name the key and the type.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from typing import Any

from deferral.config import DEFAULT_TASK_LOG_MAX_BYTES
from deferral.utils.email import EmailAlert


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
    # The task instance's max_tries: whether a failure retries decides which callback runs.
    max_tries: int
    # The run's data interval (None until recorded: a manual run) and how it was created.
    data_interval_start: dt.datetime | None = None
    data_interval_end: dt.datetime | None = None
    run_type: str = "manual"
    # The worker's DEFERRAL_TASK_LOG_MAX_BYTES: what the child keeps of the try's output.
    task_log_max_bytes: int = DEFAULT_TASK_LOG_MAX_BYTES


@dataclass(frozen=True)
class Succeeded:
    return_value: Any
    # Tasks of the run the succeeded task chose not to run (a branch, a short circuit): skipped
    # in the transaction that records the success.
    skip_task_ids: tuple[str, ...] = ()


@dataclass(frozen=True)
class Skipped:
    reason: str


@dataclass(frozen=True)
class Failed:
    error: str  # one line
    traceback: str
    allow_retry: bool
    # When the next try is due (the task's retry_delay); None: the scheduler computes it.
    retry_delay: dt.timedelta | None = None
    # What the task's email_on_failure / email_on_retry sends once the failure is committed.
    alert: EmailAlert | None = None


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
