"""Building ``deferral:events`` entries from what a trigger did.

The payload travels sealed (``broker.streams.event_message``); the triggerer keeps the clear
text beside the entry only to say in its log what fired or why it failed (:class:`Outcome`).
"""

from __future__ import annotations

import inspect
import logging
import traceback
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass
from typing import Any, cast

import anyio
import msgspec

from broker import streams
from broker.streams import EVENT_KIND_EVENT, EVENT_KIND_FAILURE, EventMessage
from deferral.runtime import serialization
from deferral.runtime.crypto import Cipher, Purpose
from deferral.runtime.process import LogExtra
from deferral.runtime.secrets_masker import mask_with_kwargs
from deferral.runtime.serialization import SerializationError
from deferral.runtime.storable import storable
from deferral.triggers.base import BaseTrigger, TriggerEvent, TriggerProgress
from deferral.triggers.task_end import end_kind

log = logging.getLogger("deferral.triggerer")


class Failure(msgspec.Struct, frozen=True):
    """The payload of a failure event."""

    message: str
    traceback: str


@dataclass(frozen=True, slots=True)
class Outcome:
    """An entry to publish, and in clear what it says (for the triggerer's own log line)."""

    message: EventMessage
    payload: str  # JSON, as sealed in message.payload
    failure: Failure | None = None


def dedup_key(cipher: Cipher, trigger_id: int, kind: str, payload_json: bytes) -> str:
    """Same trigger + same payload = same key, so a trigger that runs twice (after a takeover)
    and fires the same event resumes its task once. Keyed (an HMAC under the first Fernet key,
    as every triggerer has it): a plain digest beside the sealed payload would let anyone who
    can read the stream confirm a guess of the payload."""
    digest = cipher.sign(Purpose.STREAM_ENTRY, kind.encode() + b"\0" + payload_json)
    return f"{trigger_id}:{digest}"


def _outcome(
    cipher: Cipher,
    trigger_id: int,
    kind: str,
    payload_json: bytes,
    triggerer: str,
    failure: Failure | None = None,
) -> Outcome:
    key = dedup_key(cipher, trigger_id, kind, payload_json)
    payload = payload_json.decode()
    message = streams.event_message(cipher, trigger_id, key, kind, payload, triggerer)
    return Outcome(message, payload, failure)


def carried_json(payload: Any) -> bytes:
    """The payload's JSON; a lone surrogate in it (no UTF-8 spells one) is carried escaped, as a
    watcher's event stores it (``deferral.runtime.storable``): the trigger's event still arrives."""
    try:
        return serialization.dumps(payload, "event payload")
    except UnicodeEncodeError:
        return serialization.dumps(storable(payload), "event payload")


def failure_outcome(
    cipher: Cipher, trigger_id: int, message: str, trace: str, triggerer: str
) -> Outcome:
    failure = Failure(message, trace)
    payload = carried_json({"message": message, "traceback": trace})
    return _outcome(cipher, trigger_id, EVENT_KIND_FAILURE, payload, triggerer, failure)


def event_outcome(
    cipher: Cipher, trigger_id: int, payload: Any, triggerer: str, kind: str = EVENT_KIND_EVENT
) -> Outcome:
    """The event (of ``kind``: a task-end event has its own), or a failure naming the type if
    the payload cannot be carried."""
    try:
        payload_json = carried_json(payload)
    except SerializationError as exc:
        return failure_outcome(
            cipher, trigger_id, f"trigger {trigger_id} fired an event: {exc}", "", triggerer
        )
    return _outcome(cipher, trigger_id, kind, payload_json, triggerer)


def failure_message(
    cipher: Cipher, trigger_id: int, message: str, trace: str, triggerer: str
) -> EventMessage:
    """The entry of :func:`failure_outcome`."""
    return failure_outcome(cipher, trigger_id, message, trace, triggerer).message


def event_message(cipher: Cipher, trigger_id: int, payload: Any, triggerer: str) -> EventMessage:
    """The entry of :func:`event_outcome`."""
    return event_outcome(cipher, trigger_id, payload, triggerer).message


def masked(cipher: Cipher, outcome: Outcome, trigger_kwargs: Any) -> Outcome:
    """``outcome`` with the secrets of its trigger's kwargs (URL user info and query strings,
    values under sensitive names) masked in its payload: the payload reaches the task, its log,
    the triggerer's log and the UI. Masked before sealing, so the dedup key of an event fired
    twice (a takeover) is the same both times."""
    payload = serialization.loads(outcome.payload)
    shown = mask_with_kwargs(payload, trigger_kwargs)
    if shown == payload:
        return outcome
    failure = None if outcome.failure is None else Failure(shown["message"], shown["traceback"])
    message = outcome.message
    payload_json = carried_json(shown)
    return _outcome(
        cipher, int(message.trigger_id), message.kind, payload_json, message.triggerer, failure
    )


def raised_outcome(
    cipher: Cipher, triggerer: str, trigger_id: int, what: str, exc: BaseException
) -> Outcome:
    """A failure naming the error ``exc`` (raised in what the triggerer was doing)."""
    return failure_outcome(
        cipher,
        trigger_id,
        f"trigger {trigger_id} {what} {type(exc).__name__}: {exc}",
        "".join(traceback.format_exception(exc)),
        triggerer,
    )


async def first_event(
    cipher: Cipher,
    triggerer: str,
    trigger: BaseTrigger,
    trigger_id: int,
    log_extra: LogExtra,
    progress: Callable[[Any], None] | None = None,
) -> Outcome:
    """Run the trigger to its first event, handing each :class:`TriggerProgress` it yields
    before it to ``progress`` (None: dropped); a raise, a ``run()`` that is not an async generator
    or an end without an event is a failure. ``cleanup()`` always runs, and its own failure
    fails the task too. (A trigger calling sys.exit() fails its task, not the triggerer.) The
    triggerer service and the in-process trigger loop of ``deferral dags test`` both use it."""
    outcome: Outcome | None = None
    try:
        events = trigger.run()
        if not inspect.isasyncgen(events):
            outcome = _not_a_generator(cipher, triggerer, trigger_id, events)
        else:
            try:
                async for event in cast(
                    AsyncGenerator[TriggerEvent | TriggerProgress, None], events
                ):
                    if isinstance(event, TriggerProgress):
                        if progress is not None:
                            progress(event.payload)
                        continue
                    kind = end_kind(event) or EVENT_KIND_EVENT
                    outcome = event_outcome(cipher, trigger_id, event.payload, triggerer, kind)
                    break
            finally:
                await events.aclose()
            if outcome is None:
                outcome = failure_outcome(
                    cipher,
                    trigger_id,
                    f"trigger {trigger_id} ended without an event",
                    "",
                    triggerer,
                )
    except anyio.get_cancelled_exc_class():
        raise
    except (Exception, SystemExit) as exc:
        outcome = raised_outcome(cipher, triggerer, trigger_id, "raised", exc)
    finally:
        with anyio.CancelScope(shield=True):
            try:
                await trigger.cleanup()
            except (Exception, SystemExit) as exc:
                log.exception("trigger %d cleanup() raised", trigger_id, extra=log_extra)
                if outcome is not None and outcome.failure is None:
                    outcome = raised_outcome(cipher, triggerer, trigger_id, "cleanup() raised", exc)
    return outcome


def _not_a_generator(cipher: Cipher, triggerer: str, trigger_id: int, returned: object) -> Outcome:
    """The failure of a ``run()`` that returned something other than an async generator (an
    ``async def`` without ``yield`` returns a coroutine: closed, never run)."""
    if inspect.iscoroutine(returned):
        returned.close()
        what = "is a coroutine (async def without yield)"
    else:
        what = f"returned {type(returned).__name__}"
    return failure_outcome(
        cipher,
        trigger_id,
        f"trigger {trigger_id} run() {what}: it must be an async generator that yields"
        " TriggerEvent",
        "",
        triggerer,
    )
