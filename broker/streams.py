"""Every stream key, consumer group and field of the project, with their message schemas.

Field values are short strings or JSON so that ``redis-cli XRANGE <key> - +`` reads well; nothing
secret is ever a field in clear: trigger kwargs travel only inside the Fernet ``token``.
"""

from __future__ import annotations

from typing import TypeVar

import msgspec

from deferral.crypto import Cipher

GROUP_TRIGGERERS = "triggerers"
GROUP_SCHEDULERS = "schedulers"
GROUP_WORKERS = "workers"

EVENT_KIND_EVENT = "event"
EVENT_KIND_FAILURE = "failure"


class StreamKeys:
    """Stream key names under one prefix (``DEFERRAL_STREAM_PREFIX``, default ``deferral``)."""

    def __init__(self, prefix: str = "deferral") -> None:
        self.prefix = prefix
        self.triggers = f"{prefix}:triggers"
        self.events = f"{prefix}:events"
        self.dead = f"{prefix}:dead"
        # Set once the streams hold what Postgres says they should; its absence means Redis lost
        # its data (a restart without persistence) and the scheduler rebuilds them.
        self.epoch = f"{prefix}:epoch"

    def queue(self, name: str) -> str:
        return f"{self.prefix}:queue:{name}"


class Message(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A stream entry's fields; every field is a string on the wire."""


class TriggerMessage(Message, frozen=True):
    """``deferral:triggers``: a trigger to run. ``token`` seals the full :class:`TriggerSpec`."""

    trigger_id: str
    classpath: str
    task: str  # dag.run.task[map], for people reading the stream
    token: str


class EventMessage(Message, frozen=True):
    """``deferral:events``: what a trigger produced (``kind`` event) or why it failed (failure)."""

    trigger_id: str
    dedup_key: str
    kind: str
    payload: str  # JSON
    triggerer: str


class QueueMessage(Message, frozen=True):
    """``deferral:queue:<queue>``: a task attempt to run."""

    task_instance_id: str
    try_number: str
    task: str


class TriggerSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What the token of a :class:`TriggerMessage` decrypts to."""

    trigger_id: int
    classpath: str
    kwargs: dict[str, object]  # serialization.to_jsonable form
    task_instance_id: int
    task: str


M = TypeVar("M", bound=Message)


class MalformedEntry(ValueError):
    """A stream entry whose fields do not match the stream's schema."""


def to_fields(message: Message) -> dict[str, str]:
    return msgspec.structs.asdict(message)


def from_fields(kind: type[M], fields: dict[bytes, bytes]) -> M:
    try:
        decoded = {k.decode(): v.decode() for k, v in fields.items()}
        return msgspec.convert(decoded, kind)
    except (UnicodeDecodeError, msgspec.ValidationError) as exc:
        raise MalformedEntry(f"malformed {kind.__name__}: {exc}") from None


def task_label(dag_id: str, run_id: str, task_id: str, map_index: int) -> str:
    label = f"{dag_id}.{run_id}.{task_id}"
    return label if map_index < 0 else f"{label}[{map_index}]"


def trigger_message(
    cipher: Cipher,
    *,
    trigger_id: int,
    classpath: str,
    kwargs: dict[str, object],
    task_instance_id: int,
    task: str,
) -> TriggerMessage:
    """A triggers-stream entry: readable fields, and the whole spec sealed in the token."""
    spec = TriggerSpec(trigger_id, classpath, kwargs, task_instance_id, task)
    token = cipher.encrypt(msgspec.json.encode(spec))
    return TriggerMessage(trigger_id=str(trigger_id), classpath=classpath, task=task, token=token)


def queue_message(
    task_instance_id: int, try_number: int, dag_id: str, run_id: str, task_id: str, map_index: int
) -> QueueMessage:
    return QueueMessage(
        task_instance_id=str(task_instance_id),
        try_number=str(try_number),
        task=task_label(dag_id, run_id, task_id, map_index),
    )
