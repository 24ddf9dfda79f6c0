"""Building ``deferral:events`` entries from what a trigger did."""

from __future__ import annotations

import hashlib
from typing import Any

from broker import streams
from broker.streams import EVENT_KIND_EVENT, EVENT_KIND_FAILURE, EventMessage
from deferral import serialization
from deferral.crypto import Cipher
from deferral.secrets_masker import mask_with_kwargs
from deferral.serialization import SerializationError


def dedup_key(trigger_id: int, kind: str, payload_json: bytes) -> str:
    """Same trigger + same payload = same key, so a trigger that runs twice (after a takeover)
    and fires the same event resumes its task once."""
    digest = hashlib.sha256(kind.encode() + b"\0" + payload_json).hexdigest()[:32]
    return f"{trigger_id}:{digest}"


def _message(
    cipher: Cipher, trigger_id: int, kind: str, payload_json: bytes, triggerer: str
) -> EventMessage:
    key = dedup_key(trigger_id, kind, payload_json)
    return streams.event_message(cipher, trigger_id, key, kind, payload_json.decode(), triggerer)


def failure_message(
    cipher: Cipher, trigger_id: int, message: str, trace: str, triggerer: str
) -> EventMessage:
    payload = serialization.dumps({"message": message, "traceback": trace})
    return _message(cipher, trigger_id, EVENT_KIND_FAILURE, payload, triggerer)


def event_message(cipher: Cipher, trigger_id: int, payload: Any, triggerer: str) -> EventMessage:
    """The event, or a failure naming the type if the payload cannot be carried."""
    try:
        payload_json = serialization.dumps(payload, "event payload")
    except SerializationError as exc:
        return failure_message(
            cipher, trigger_id, f"trigger {trigger_id} fired an event: {exc}", "", triggerer
        )
    return _message(cipher, trigger_id, EVENT_KIND_EVENT, payload_json, triggerer)


def masked(cipher: Cipher, message: EventMessage, trigger_kwargs: Any) -> EventMessage:
    """``message`` with the secrets of its trigger's kwargs (URL user info and query strings,
    values under sensitive names) masked in its payload: the payload is shown in the events
    stream, the triggerer's log, the task's log and the UI, and reaches the task."""
    try:
        payload = serialization.loads(message.payload)
    except SerializationError:
        return message  # built by event_message / failure_message: not reached
    shown = mask_with_kwargs(payload, trigger_kwargs)
    if shown == payload:
        return message
    payload_json = serialization.dumps(shown, "event payload")
    return _message(cipher, int(message.trigger_id), message.kind, payload_json, message.triggerer)
