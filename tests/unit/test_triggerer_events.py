"""triggerer.events: deferral:events entries and their dedup keys."""

from __future__ import annotations

import datetime as dt
from typing import Any

import pytest
from cryptography.fernet import Fernet

from broker.streams import EVENT_KIND_EVENT, EVENT_KIND_FAILURE, EventMessage, read_event, to_fields
from deferral import serialization
from deferral.crypto import Cipher
from triggerer.events import dedup_key, event_message, failure_message, masked

CIPHER = Cipher([Fernet.generate_key().decode()])


def test_event_message_fields() -> None:
    message = event_message(CIPHER, 5, {"status": "done", "n": 3}, "triggerer-a")
    assert isinstance(message, EventMessage)
    assert message.trigger_id == "5"
    assert message.kind == EVENT_KIND_EVENT
    assert message.triggerer == "triggerer-a"
    assert message.payload == '{"n":3,"status":"done"}'
    assert message.dedup_key.startswith("5:")
    assert message.dedup_key == dedup_key(5, "event", message.payload.encode())


def test_event_payload_round_trips_tagged_values() -> None:
    moment = dt.datetime(2030, 1, 1, tzinfo=dt.UTC)
    payload = {"at": moment, "pair": (1, 2), "wait": dt.timedelta(seconds=-1)}
    message = event_message(CIPHER, 1, payload, "t")
    assert serialization.loads(message.payload) == payload


def test_datetime_trigger_payload_is_carried() -> None:
    moment = dt.datetime(2030, 1, 1, tzinfo=dt.UTC)
    message = event_message(CIPHER, 3, moment, "t")
    assert message.kind == EVENT_KIND_EVENT
    assert serialization.loads(message.payload) == moment


def test_equal_payloads_give_equal_dedup_keys_whatever_the_triggerer() -> None:
    a = event_message(CIPHER, 9, {"x": 1, "y": [1, 2]}, "triggerer-a")
    b = event_message(
        CIPHER, 9, {"y": [1, 2], "x": 1}, "triggerer-b"
    )  # other key order, other host
    assert a.dedup_key == b.dedup_key
    assert a.payload == b.payload


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
    assert dedup_key(4, "event", payload) != dedup_key(4, "failure", payload)
    assert dedup_key(4, "event", payload) == dedup_key(4, "event", payload)


def test_dedup_key_shape() -> None:
    key = dedup_key(123, "event", b"null")
    trigger_id, digest = key.split(":")
    assert trigger_id == "123"
    assert len(digest) == 32
    int(digest, 16)


def test_unserializable_payload_becomes_a_failure_naming_the_type() -> None:
    message = event_message(CIPHER, 7, {"conn": object()}, "triggerer-a")
    assert message.kind == EVENT_KIND_FAILURE
    assert message.trigger_id == "7"
    assert message.triggerer == "triggerer-a"
    payload = serialization.loads(message.payload)
    assert set(payload) == {"message", "traceback"}
    assert "trigger 7" in payload["message"]
    assert "event payload['conn']" in payload["message"]
    assert "object" in payload["message"]


def test_unserializable_payload_failure_is_deterministic() -> None:
    a = event_message(CIPHER, 7, {1, 2}, "a")
    b = event_message(CIPHER, 7, {3}, "b")
    assert a.kind == b.kind == EVENT_KIND_FAILURE
    assert a.dedup_key == b.dedup_key  # same failure message: "unsupported type set"
    assert "set" in serialization.loads(a.payload)["message"]


def test_failure_message() -> None:
    message = failure_message(CIPHER, 2, "run() raised ValueError: x", "Traceback...\n", "t1")
    assert message.kind == EVENT_KIND_FAILURE
    assert serialization.loads(message.payload) == {
        "message": "run() raised ValueError: x",
        "traceback": "Traceback...\n",
    }
    assert message.dedup_key == dedup_key(2, "failure", message.payload.encode())
    again = failure_message(CIPHER, 2, "run() raised ValueError: x", "Traceback...\n", "t2")
    assert again.dedup_key == message.dedup_key


def test_events_are_signed_and_read_back() -> None:
    message = event_message(CIPHER, 5, {"n": 1}, "t")
    fields = {k.encode(): v.encode() for k, v in to_fields(message).items()}
    event = read_event(CIPHER, fields)
    assert (event.trigger_id, event.failed) == (5, False)


KWARGS = {"url": "https://bob:pw-s3cret@h.example/x?token=q-s3cret", "expected_status": 200}


def _read(message: EventMessage) -> Any:
    fields = {k.encode(): v.encode() for k, v in to_fields(message).items()}
    return read_event(CIPHER, fields)


def test_an_event_is_masked_with_its_triggers_kwargs_and_stays_authentic() -> None:
    message = event_message(CIPHER, 5, {"url": KWARGS["url"], "status": 200}, "t")
    shown = masked(CIPHER, message, KWARGS)
    assert "s3cret" not in str(to_fields(shown))
    assert serialization.loads(shown.payload) == {
        "url": "https://***@h.example/x?***",
        "status": 200,
    }
    assert shown.dedup_key == dedup_key(5, "event", shown.payload.encode())
    assert _read(shown).trigger_id == 5  # signed anew: the scheduler accepts it
    # The same event fired twice (a takeover) is masked the same: one resume.
    again = masked(
        CIPHER, event_message(CIPHER, 5, {"url": KWARGS["url"], "status": 200}, "u"), KWARGS
    )
    assert again.dedup_key == shown.dedup_key


def test_a_failure_is_masked_too() -> None:
    trace = f"Traceback...\nURLError: {KWARGS['url']}\n"
    message = failure_message(CIPHER, 2, "run() raised: q-s3cret refused", trace, "t")
    shown = masked(CIPHER, message, KWARGS)
    assert shown.kind == EVENT_KIND_FAILURE and "s3cret" not in shown.payload
    assert _read(shown).failed


def test_an_event_without_secrets_is_left_as_it_is() -> None:
    message = event_message(CIPHER, 5, {"status": 200}, "t")
    assert masked(CIPHER, message, KWARGS) is message
