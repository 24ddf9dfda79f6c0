"""What one task attempt is asked to do and what it ended with, as the worker and its task
process send them to each other (msgspec JSON over the child's pipe: encoding and decoding them
takes a twentieth of the time pickle did, which mattered at hundreds of attempts a second; JSON,
not MessagePack, because it carries integers of any size, as the values' own encoding does).

Values are in serialization.to_jsonable form both ways (plain JSON types, datetimes, timedeltas
and tuples tagged), so the pipe carries them exactly: a value that cannot be carried was refused
in the child, where the error can name the key and the type.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

import msgspec

from deferral.runtime.config import DEFAULT_TASK_LOG_MAX_BYTES
from deferral.utils.email import EmailAlert


class AttemptRequest(msgspec.Struct, frozen=True, kw_only=True):
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
    # The resume kwargs, in to_jsonable form (the task process restores them).
    next_kwargs: dict[str, Any] | None
    # The task instance's max_tries: whether a failure retries decides which callback runs.
    max_tries: int
    # The run's data interval (None until recorded: a manual run) and how it was created.
    data_interval_start: dt.datetime | None = None
    data_interval_end: dt.datetime | None = None
    run_type: str = "manual"
    # The worker's DEFERRAL_TASK_LOG_MAX_BYTES: what the child keeps of the try's output.
    task_log_max_bytes: int = DEFAULT_TASK_LOG_MAX_BYTES
    # What the worker adds to its host's time to read the database's (deferral.runtime.clock):
    # a task process, forked before the worker measured it, counts a deferral's delta from it.
    clock_correction_sec: float = 0.0


class Succeeded(msgspec.Struct, frozen=True, tag=True):
    return_value: Any
    # Tasks of the run the succeeded task chose not to run (a branch, a short circuit): skipped
    # in the transaction that records the success.
    skip_task_ids: tuple[str, ...] = ()
    # The extra of each outlet's asset event the task annotated (context["outlet_events"],
    # Metadata), by asset name: recorded in the transaction that records the success.
    outlet_extras: dict[str, dict[str, Any]] = msgspec.field(default_factory=dict)
    # The events the task added through aliases in its outlets (OutletEventAccessors
    # .alias_events): recorded in the transaction that records the success.
    alias_events: list[dict[str, Any]] = msgspec.field(default_factory=list)


class Skipped(msgspec.Struct, frozen=True, tag=True):
    reason: str


class Failed(msgspec.Struct, frozen=True, tag=True):
    error: str  # one line
    traceback: str
    allow_retry: bool
    # When the next try is due (the task's retry_delay); None: the scheduler computes it.
    retry_delay: dt.timedelta | None = None
    # What the task's email_on_failure / email_on_retry sends once the failure is committed.
    alert: EmailAlert | None = None


class Deferred(msgspec.Struct, frozen=True, tag=True):
    classpath: str
    trigger_kwargs: dict[str, Any]
    method_name: str
    next_kwargs: dict[str, Any]
    trigger_timeout: dt.datetime | None
    # The trigger's class opts in to sharing (BaseTrigger.shared).
    shared: bool = False
    # defer(cancel_on=): the SignalTrigger's kwargs (to_jsonable form) and the state it ends in.
    cancel_on: dict[str, Any] | None = None
    cancel_state: str = "skipped"


class Rescheduled(msgspec.Struct, frozen=True, tag=True):
    reschedule_date: dt.datetime


class AwaitingInput(msgspec.Struct, frozen=True, tag=True):
    """What an HITLOperator asks (deferral.store.hitl.InputRequest's fields, checked in the
    child)."""

    subject: str
    body: str | None
    options: tuple[str, ...]
    defaults: tuple[str, ...] | None
    multiple: bool
    params: dict[str, Any]
    timeout: dt.timedelta | None


Outcome = Succeeded | Skipped | Failed | Deferred | Rescheduled | AwaitingInput

_encoder = msgspec.json.Encoder()
_request_decoder = msgspec.json.Decoder(AttemptRequest)
_outcome_decoder: msgspec.json.Decoder[Outcome] = msgspec.json.Decoder(Outcome)


def encode(message: AttemptRequest | Outcome) -> bytes:
    return _encoder.encode(message)


def decode_request(data: bytes) -> AttemptRequest:
    return _request_decoder.decode(data)


def decode_outcome(data: bytes) -> Outcome:
    return _outcome_decoder.decode(data)
