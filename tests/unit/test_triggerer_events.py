"""triggerer.events: deferral:events entries (their payload sealed) and their dedup keys."""

from __future__ import annotations

import datetime as dt
from collections.abc import AsyncIterator
from typing import Any

import anyio
import pytest
from cryptography.fernet import Fernet

from broker.streams import EVENT_KIND_EVENT, EVENT_KIND_FAILURE, EventMessage, read_event, to_fields
from deferral.runtime import serialization
from deferral.runtime.crypto import Cipher, Purpose
from deferral.triggers import TriggerEvent, TriggerProgress
from deferral.triggers.base import BaseTrigger
from triggerer.events import (
    dedup_key,
    event_message,
    event_outcome,
    failure_message,
    failure_outcome,
    first_event,
    masked,
)

CIPHER = Cipher([Fernet.generate_key().decode()])


def test_event_message_fields() -> None:
    outcome = event_outcome(CIPHER, 5, {"status": "done", "n": 3}, "triggerer-a")
    message = outcome.message
    assert isinstance(message, EventMessage)
    assert message.trigger_id == "5"
    assert message.kind == EVENT_KIND_EVENT
    assert message.triggerer == "triggerer-a"
    assert outcome.payload == '{"n":3,"status":"done"}'
    assert CIPHER.decrypt(Purpose.EVENT, message.payload) == b'{"n":3,"status":"done"}'  # sealed
    assert message.dedup_key.startswith("5:")
    assert message.dedup_key == dedup_key(CIPHER, 5, "event", outcome.payload.encode())


def test_nothing_of_the_payload_is_in_clear_in_the_entry() -> None:
    canary = "canary-5ecret-7d1e"
    fields = to_fields(event_message(CIPHER, 5, {"token": canary}, "t"))
    assert not any(canary in value or "token" in value for value in fields.values())
    # Nor can a guess be confirmed from the dedup key: it is keyed.
    other = Cipher([Fernet.generate_key().decode()])
    payload = serialization.dumps({"token": canary})
    assert dedup_key(CIPHER, 5, "event", payload) != dedup_key(other, 5, "event", payload)


def test_event_payload_round_trips_tagged_values() -> None:
    moment = dt.datetime(2030, 1, 1, tzinfo=dt.UTC)
    payload = {"at": moment, "pair": (1, 2), "wait": dt.timedelta(seconds=-1)}
    outcome = event_outcome(CIPHER, 1, payload, "t")
    assert serialization.loads(outcome.payload) == payload


def test_datetime_trigger_payload_is_carried() -> None:
    moment = dt.datetime(2030, 1, 1, tzinfo=dt.UTC)
    outcome = event_outcome(CIPHER, 3, moment, "t")
    assert outcome.message.kind == EVENT_KIND_EVENT
    assert serialization.loads(outcome.payload) == moment


def test_equal_payloads_give_equal_dedup_keys_whatever_the_triggerer() -> None:
    a = event_message(CIPHER, 9, {"x": 1, "y": [1, 2]}, "triggerer-a")
    b = event_message(
        CIPHER, 9, {"y": [1, 2], "x": 1}, "triggerer-b"
    )  # other key order, other host
    assert a.dedup_key == b.dedup_key


@pytest.mark.parametrize(
    ("first", "second"),
    [
        ({"x": 1}, {"x": 2}),
        ({"x": 1}, {"x": 1.5}),
        ([1, 2], (1, 2)),  # a tuple is not a list
        (None, {}),
        ("1", 1),
    ],
)
def test_different_payloads_give_different_dedup_keys(first: Any, second: Any) -> None:
    assert (
        event_message(CIPHER, 9, first, "t").dedup_key
        != event_message(CIPHER, 9, second, "t").dedup_key
    )


def test_same_payload_of_different_triggers_gives_different_keys() -> None:
    assert (
        event_message(CIPHER, 1, "x", "t").dedup_key != event_message(CIPHER, 2, "x", "t").dedup_key
    )


def test_dedup_key_depends_on_kind() -> None:
    payload = b'{"a":1}'
    assert dedup_key(CIPHER, 4, "event", payload) != dedup_key(CIPHER, 4, "failure", payload)
    assert dedup_key(CIPHER, 4, "event", payload) == dedup_key(CIPHER, 4, "event", payload)


def test_dedup_key_shape() -> None:
    key = dedup_key(CIPHER, 123, "event", b"null")
    trigger_id, digest = key.split(":")
    assert trigger_id == "123"
    assert len(digest) == 43  # an HMAC-SHA256, base64url without padding


def test_unserializable_payload_becomes_a_failure_naming_the_type() -> None:
    outcome = event_outcome(CIPHER, 7, {"conn": object()}, "triggerer-a")
    message = outcome.message
    assert message.kind == EVENT_KIND_FAILURE
    assert message.trigger_id == "7"
    assert message.triggerer == "triggerer-a"
    payload = serialization.loads(outcome.payload)
    assert set(payload) == {"message", "traceback"}
    assert "trigger 7" in payload["message"]
    assert "event payload['conn']" in payload["message"]
    assert "object" in payload["message"]


def test_unserializable_payload_failure_is_deterministic() -> None:
    a = event_outcome(CIPHER, 7, {1, 2}, "a")
    b = event_message(CIPHER, 7, {3}, "b")
    assert a.message.kind == b.kind == EVENT_KIND_FAILURE
    assert a.message.dedup_key == b.dedup_key  # same failure message: "unsupported type set"
    assert "set" in serialization.loads(a.payload)["message"]


def test_failure_message() -> None:
    outcome = failure_outcome(CIPHER, 2, "run() raised ValueError: x", "Traceback...\n", "t1")
    message = outcome.message
    assert message.kind == EVENT_KIND_FAILURE
    assert serialization.loads(outcome.payload) == {
        "message": "run() raised ValueError: x",
        "traceback": "Traceback...\n",
    }
    assert outcome.failure is not None
    assert outcome.failure.message == "run() raised ValueError: x"
    assert message.dedup_key == dedup_key(CIPHER, 2, "failure", outcome.payload.encode())
    again = failure_message(CIPHER, 2, "run() raised ValueError: x", "Traceback...\n", "t2")
    assert again.dedup_key == message.dedup_key


def test_events_are_signed_and_read_back() -> None:
    message = event_message(CIPHER, 5, {"n": 1}, "t")
    fields = {k.encode(): v.encode() for k, v in to_fields(message).items()}
    event = read_event(CIPHER, fields)
    assert (event.trigger_id, event.failed) == (5, False)
    assert event.payload == '{"n":1}'  # opened


KWARGS = {"url": "https://bob:pw-s3cret@h.example/x?token=q-s3cret", "expected_status": 200}


def _read(message: EventMessage) -> Any:
    return read_event(CIPHER, {k.encode(): v.encode() for k, v in to_fields(message).items()})


def test_an_event_is_masked_with_its_triggers_kwargs_and_stays_authentic() -> None:
    outcome = event_outcome(CIPHER, 5, {"url": KWARGS["url"], "status": 200}, "t")
    shown = masked(CIPHER, outcome, KWARGS)
    assert "s3cret" not in shown.payload
    assert serialization.loads(shown.payload) == {
        "url": "https://***@h.example/x?***",
        "status": 200,
    }
    event = _read(shown.message)  # signed anew: the scheduler accepts it
    assert event.trigger_id == 5 and "s3cret" not in event.payload
    # The same event fired twice (a takeover) is masked the same: one resume.
    again = masked(
        CIPHER, event_outcome(CIPHER, 5, {"url": KWARGS["url"], "status": 200}, "u"), KWARGS
    )
    assert again.message.dedup_key == shown.message.dedup_key


def test_a_failure_is_masked_too() -> None:
    trace = f"Traceback...\nURLError: {KWARGS['url']}\n"
    outcome = failure_outcome(CIPHER, 2, "run() raised: q-s3cret refused", trace, "t")
    shown = masked(CIPHER, outcome, KWARGS)
    assert shown.message.kind == EVENT_KIND_FAILURE and "s3cret" not in shown.payload
    assert shown.failure is not None and "s3cret" not in str(shown.failure)
    assert _read(shown.message).failed


def test_an_event_without_secrets_is_left_as_it_is() -> None:
    outcome = event_outcome(CIPHER, 5, {"status": 200}, "t")
    assert masked(CIPHER, outcome, KWARGS) is outcome


def test_a_lone_surrogate_in_an_event_or_a_failure_is_carried_escaped() -> None:
    event = event_outcome(CIPHER, 5, {"text": "bad \ud800", "pair": ("\udfff",)}, "triggerer-a")
    assert event.failure is None
    assert serialization.loads(event.payload) == {"text": "bad \\ud800", "pair": ("\\udfff",)}
    failure = failure_outcome(CIPHER, 5, "raised \udc80", "Traceback \udc80", "triggerer-a")
    assert serialization.loads(failure.payload) == {
        "message": "raised \\udc80",
        "traceback": "Traceback \\udc80",
    }


def test_progress_before_the_event_goes_to_its_handler_and_only_the_event_is_the_outcome() -> None:
    class Reports(BaseTrigger):
        def serialize(self) -> tuple[str, dict[str, Any]]:
            return "x.Reports", {}

        async def run(self) -> AsyncIterator[TriggerEvent | TriggerProgress]:
            for step in range(5):
                yield TriggerProgress(step)
            yield TriggerEvent("done")

    seen: list[Any] = []
    outcome = anyio.run(first_event, CIPHER, "t1", Reports(), 3, {}, seen.append)
    assert seen == [0, 1, 2, 3, 4] and outcome.payload == '"done"' and outcome.failure is None
    # Without a handler (deferral dags test), progress is dropped and the event still comes.
    assert anyio.run(first_event, CIPHER, "t1", Reports(), 3, {}).payload == '"done"'
