"""broker.streams: message schemas on the wire."""

from __future__ import annotations

import pytest

from broker.streams import (
    EventMessage,
    MalformedEntry,
    Message,
    QueueMessage,
    StreamKeys,
    TriggerMessage,
    from_fields,
    task_label,
    to_fields,
)

MESSAGES: list[Message] = [
    TriggerMessage(trigger_id="12", classpath="a.b.C", task="d.r.t", token="gAAAAtoken"),
    EventMessage(
        trigger_id="12",
        dedup_key="12:abcd",
        kind="event",
        payload='{"a":[1,2]}',
        triggerer="host-1",
    ),
    QueueMessage(task_instance_id="99", try_number="2", task="dag.run.task[3]"),
]


def wire(fields: dict[str, str]) -> dict[bytes, bytes]:
    """What Redis gives back for fields written as str (RESP2, decode_responses=False)."""
    return {k.encode(): v.encode() for k, v in fields.items()}


@pytest.mark.parametrize("message", MESSAGES, ids=lambda m: type(m).__name__)
def test_to_fields_from_fields_round_trip(message: Message) -> None:
    fields = to_fields(message)
    assert all(isinstance(k, str) and isinstance(v, str) for k, v in fields.items())
    back = from_fields(type(message), wire(fields))
    assert back == message
    assert type(back) is type(message)


def test_to_fields_names() -> None:
    assert to_fields(MESSAGES[0]) == {
        "trigger_id": "12",
        "classpath": "a.b.C",
        "task": "d.r.t",
        "token": "gAAAAtoken",
    }
    assert set(to_fields(MESSAGES[1])) == {
        "trigger_id",
        "dedup_key",
        "kind",
        "payload",
        "triggerer",
    }
    assert set(to_fields(MESSAGES[2])) == {"task_instance_id", "try_number", "task"}


def test_non_ascii_utf8_values_round_trip() -> None:
    message = QueueMessage(task_instance_id="1", try_number="1", task="dàg.rün.tâsk")
    assert from_fields(QueueMessage, wire(to_fields(message))) == message


@pytest.mark.parametrize("message", MESSAGES, ids=lambda m: type(m).__name__)
def test_missing_field_is_malformed(message: Message) -> None:
    fields = wire(to_fields(message))
    missing = next(iter(fields))
    del fields[missing]
    with pytest.raises(MalformedEntry) as info:
        from_fields(type(message), fields)
    assert f"malformed {type(message).__name__}" in str(info.value)
    assert missing.decode() in str(info.value)


@pytest.mark.parametrize("message", MESSAGES, ids=lambda m: type(m).__name__)
def test_unknown_field_is_malformed(message: Message) -> None:
    fields = wire(to_fields(message))
    fields[b"surprise"] = b"x"
    with pytest.raises(MalformedEntry, match="surprise"):
        from_fields(type(message), fields)


def test_non_utf8_value_is_malformed() -> None:
    fields = wire(to_fields(MESSAGES[2]))
    fields[b"task"] = b"\xff\xfe"
    with pytest.raises(MalformedEntry, match="malformed QueueMessage"):
        from_fields(QueueMessage, fields)


def test_non_utf8_key_is_malformed() -> None:
    fields = wire(to_fields(MESSAGES[2]))
    fields[b"\xc3\x28"] = b"x"
    with pytest.raises(MalformedEntry):
        from_fields(QueueMessage, fields)


def test_empty_fields_are_malformed() -> None:
    with pytest.raises(MalformedEntry):
        from_fields(TriggerMessage, {})


def test_wrong_schema_is_malformed() -> None:
    with pytest.raises(MalformedEntry):
        from_fields(QueueMessage, wire(to_fields(MESSAGES[0])))


def test_messages_are_frozen() -> None:
    with pytest.raises(AttributeError):
        MESSAGES[2].task = "other"  # type: ignore[misc]


@pytest.mark.parametrize(
    ("map_index", "expected"),
    [(-1, "dag.run_1.task"), (0, "dag.run_1.task[0]"), (12, "dag.run_1.task[12]")],
)
def test_task_label(map_index: int, expected: str) -> None:
    assert task_label("dag", "run_1", "task", map_index) == expected


def test_stream_keys() -> None:
    keys = StreamKeys("pfx")
    assert keys.triggers == "pfx:triggers"
    assert keys.events == "pfx:events"
    assert keys.dead == "pfx:dead"
    assert keys.queue("default") == "pfx:queue:default"
    assert StreamKeys().triggers == "deferral:triggers"
