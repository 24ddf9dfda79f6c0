"""broker.streams: message schemas on the wire."""

from __future__ import annotations

import pytest
from cryptography.fernet import Fernet

from broker import streams
from broker.streams import (
    MAX_BIGINT,
    MAX_CARRIED_LOG,
    CarriedLog,
    Event,
    EventMessage,
    ForgedEntry,
    MalformedEntry,
    Message,
    QueuedAttempt,
    QueueMessage,
    StreamKeys,
    TriggerMessage,
    event_message,
    from_fields,
    queue_message,
    read_event,
    read_queue_entry,
    task_label,
    to_fields,
    with_log,
)
from deferral.runtime.crypto import Cipher, Purpose

KEY = Fernet.generate_key().decode()
CIPHER = Cipher([KEY])

MESSAGES: list[Message] = [
    TriggerMessage(trigger_id="12", classpath="a.b.C", task="d.r.t", token="gAAAAtoken"),
    EventMessage(
        trigger_id="12",
        dedup_key="12:abcd",
        kind="event",
        payload='{"a":[1,2]}',
        triggerer="host-1",
        mac="m",
    ),
    QueueMessage(task_instance_id="99", try_number="2", task="dag.run.task[3]", mac="m"),
    streams.ProgressMessage(progress_of="12", payload="gAAAAsealed", triggerer="host-1", mac="m"),
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
        "mac",
        "log",
    }
    assert set(to_fields(MESSAGES[2])) == {"task_instance_id", "try_number", "task", "mac"}


def test_non_ascii_utf8_values_round_trip() -> None:
    message = QueueMessage(task_instance_id="1", try_number="1", task="dàg.rün.tâsk", mac="m")
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


def test_in_flight_indexes_and_their_fields() -> None:
    keys = StreamKeys("pfx")
    assert keys.inflight(keys.triggers) == "pfx:inflight:triggers"
    assert keys.inflight(keys.queue("q")) == "pfx:inflight:queue:q"
    assert keys.index_field(keys.triggers, {"trigger_id": "7", "task": "x"}) == "7"
    assert keys.index_field(keys.events, {"trigger_id": "7"}) == "7"
    assert keys.index_field(keys.queue("q"), {"task_instance_id": "9"}) == "9"
    assert keys.index_field(keys.dead, {"trigger_id": "7"}) == ""


# -- authenticated entries ---------------------------------------------------------------------


def _wire(message: Message) -> dict[bytes, bytes]:
    return wire(to_fields(message))


def test_signed_queue_entry_reads_back() -> None:
    message = queue_message(CIPHER, 41, 3, "d", "r", "t", -1)
    assert read_queue_entry(CIPHER, _wire(message)) == QueuedAttempt(41, 3, "d.r.t")


def test_signed_event_reads_back() -> None:
    message = event_message(CIPHER, 7, "7:abc", "failure", '{"message": "x"}', "trig-1")
    assert read_event(CIPHER, _wire(message)) == Event(
        7, "7:abc", True, '{"message": "x"}', "trig-1", sealed_payload=message.payload
    )


@pytest.mark.parametrize("field", ["task_instance_id", "try_number", "task"])
def test_a_changed_queue_field_fails_authentication(field: str) -> None:
    fields = to_fields(queue_message(CIPHER, 41, 3, "d", "r", "t", -1))
    fields[field] = "5" if field != "task" else "d.r.other"
    with pytest.raises(ForgedEntry, match="failed authentication"):
        read_queue_entry(CIPHER, wire(fields))


@pytest.mark.parametrize("field", ["trigger_id", "dedup_key", "kind", "payload", "triggerer"])
def test_a_changed_event_field_fails_authentication(field: str) -> None:
    fields = to_fields(event_message(CIPHER, 7, "7:abc", "event", "1", "t"))
    fields[field] = {"trigger_id": "8", "kind": "failure"}.get(field, "forged")
    with pytest.raises(ForgedEntry):
        read_event(CIPHER, wire(fields))


def test_an_entry_signed_with_another_key_is_forged_until_that_key_is_listed() -> None:
    other = Fernet.generate_key().decode()
    fields = _wire(queue_message(Cipher([other]), 1, 1, "d", "r", "t", -1))
    with pytest.raises(ForgedEntry):
        read_queue_entry(CIPHER, fields)
    assert read_queue_entry(Cipher([KEY, other]), fields).task_instance_id == 1


def test_a_hand_written_entry_without_mac_is_malformed() -> None:
    with pytest.raises(MalformedEntry, match="mac"):
        read_event(
            CIPHER,
            wire(
                {
                    "trigger_id": "1",
                    "dedup_key": "k",
                    "kind": "event",
                    "payload": "1",
                    "triggerer": "x",
                }
            ),
        )


@pytest.mark.parametrize(
    ("value", "fragment"),
    [
        (str(MAX_BIGINT + 1), "out of range"),
        ("0", "out of range"),
        ("-4", "not a positive integer"),
        ("12a", "not a positive integer"),
        ("\uff19", "not a positive integer"),  # a full-width digit: isdigit() but not ASCII
        ("1" * 40, "not a positive integer"),
    ],
)
def test_out_of_range_ids_are_refused_naming_the_field(value: str, fragment: str) -> None:
    fields = to_fields(queue_message(CIPHER, 1, 1, "d", "r", "t", -1))
    fields["task_instance_id"] = value
    with pytest.raises(MalformedEntry, match=f"task_instance_id .*{fragment}"):
        read_queue_entry(CIPHER, wire(fields))


def test_event_kind_and_dedup_key_are_checked() -> None:
    fields = to_fields(event_message(CIPHER, 7, "k", "event", "1", "t"))
    with pytest.raises(MalformedEntry, match="unknown event kind"):
        read_event(CIPHER, wire({**fields, "kind": "explode"}))
    with pytest.raises(MalformedEntry, match="dedup_key"):
        read_event(CIPHER, wire({**fields, "dedup_key": "k" * 251}))


def test_an_event_carries_its_tries_log_lines_signed() -> None:
    log = CarriedLog(41, 2, [(1.5, "fired: 1"), (2.0, "second")])
    message = with_log(CIPHER, event_message(CIPHER, 7, "7:abc", "event", "1", "t"), log)
    assert read_event(CIPHER, _wire(message)) == Event(
        7, "7:abc", False, "1", "t", log, sealed_payload=message.payload
    )

    fields = to_fields(message)
    assert "second" not in fields["log"]  # sealed
    fields["log"] = CIPHER.encrypt(
        Purpose.CARRIED_LOG, b'[41,2,[[1.5,"forged"]]]'
    )  # sealed, but not signed
    with pytest.raises(ForgedEntry):
        read_event(CIPHER, wire(fields))


def _signed(message: EventMessage, **raw: str) -> dict[bytes, bytes]:
    """``message`` with fields replaced by ``raw`` values, signed again: what a holder of the
    key could write, for checks made after the MAC."""
    fields = {**to_fields(message), **raw}
    signed = [fields[k] for k in ("trigger_id", "dedup_key", "kind", "payload", "triggerer")]
    if fields["log"]:
        signed.append(fields["log"])
    fields["mac"] = streams._sign(CIPHER, *signed)
    return wire(fields)


def test_an_event_payload_travels_sealed_and_is_opened_after_the_mac() -> None:
    message = event_message(CIPHER, 7, "7:abc", "event", '{"token":"s3cret"}', "t")
    assert "s3cret" not in message.payload
    assert read_event(CIPHER, _wire(message)).payload == '{"token":"s3cret"}'
    # A payload signed but not sealed (clear JSON) is refused, naming the field.
    with pytest.raises(ForgedEntry, match="payload failed authentication"):
        read_event(CIPHER, _signed(message, payload='{"token":"s3cret"}'))


def test_an_event_written_before_logs_travelled_still_reads() -> None:
    fields = to_fields(event_message(CIPHER, 7, "7:abc", "event", "1", "t"))
    del fields["log"]  # the field did not exist, and the MAC did not cover it
    assert read_event(CIPHER, wire(fields)).log is None


@pytest.mark.parametrize(
    ("log", "fragment"),
    [
        ('{"lines": []}', "log is not a carried log"),
        ('[1, 2, [["at", "text"]]]', "log is not a carried log"),
        ("[0, 1, []]", "log task_instance_id 0 is out of range"),
        (f"[1, {2**31}, []]", "log try_number 2147483648 is out of range"),
        ("[1, 1, []]" + " " * MAX_CARRIED_LOG, "log is longer than"),
    ],
)
def test_a_bad_carried_log_is_malformed_naming_it(log: str, fragment: str) -> None:
    message = event_message(CIPHER, 7, "7:abc", "event", "1", "t")
    with pytest.raises(MalformedEntry, match=fragment):
        read_event(CIPHER, _signed(message, log=CIPHER.encrypt(Purpose.CARRIED_LOG, log.encode())))


def test_an_oversized_sealed_log_is_refused_before_anything_is_opened() -> None:
    fields = to_fields(event_message(CIPHER, 7, "7:abc", "event", "1", "t"))
    with pytest.raises(MalformedEntry, match="log is longer than"):
        read_event(CIPHER, wire({**fields, "log": "x" * (streams.MAX_SEALED_LOG + 1)}))


def test_a_log_too_long_to_travel_is_refused() -> None:
    log = CarriedLog(1, 1, [(1.0, "x" * MAX_CARRIED_LOG)])
    with pytest.raises(MalformedEntry, match="too long"):
        with_log(CIPHER, event_message(CIPHER, 7, "k", "event", "1", "t"), log)


# -- progress reports -------------------------------------------------------------------------


def test_a_progress_report_reads_back_sealed_and_is_no_event_nor_indexed() -> None:
    message = streams.progress_message(CIPHER, 7, '{"step": 1}', "trig-1")
    fields = to_fields(message)
    assert "step" not in str(fields)  # sealed
    read = streams.read_progress(CIPHER, wire(fields))
    assert read == streams.Progress(7, message.payload, "trig-1")
    assert CIPHER.decrypt(Purpose.EVENT, read.sealed_payload) == b'{"step": 1}'
    assert streams.is_progress(wire(fields)) and not streams.is_wake(wire(fields))
    keys = StreamKeys("p")
    assert keys.index_field(keys.events, fields) == ""  # the trigger's event keeps its index
    with pytest.raises(MalformedEntry):
        read_event(CIPHER, wire(fields))


@pytest.mark.parametrize("field", ["progress_of", "payload", "triggerer"])
def test_a_changed_progress_field_fails_authentication(field: str) -> None:
    fields = to_fields(streams.progress_message(CIPHER, 7, "1", "t"))
    fields[field] = {"progress_of": "8"}.get(field, "forged")
    with pytest.raises(ForgedEntry):
        streams.read_progress(CIPHER, wire(fields))


def test_an_event_mac_does_not_authenticate_a_progress_report() -> None:
    event = event_message(CIPHER, 7, "7:abc", "event", "1", "t")
    forged = {"progress_of": "7", "payload": event.payload, "triggerer": "t", "mac": event.mac}
    with pytest.raises(ForgedEntry):
        streams.read_progress(CIPHER, wire(forged))


def test_progress_reports_are_bounded_in_one_line() -> None:
    big = '"' + "x" * streams.MAX_PROGRESS_PAYLOAD + '"'
    with pytest.raises(MalformedEntry, match=r"^a progress payload of 8194 bytes is over 8192$"):
        streams.progress_message(CIPHER, 7, big, "t")
    fields = to_fields(streams.progress_message(CIPHER, 7, "1", "t"))
    fields["payload"] = "A" * (streams.MAX_SEALED_PROGRESS + 1)
    with pytest.raises(MalformedEntry, match="payload is longer than"):
        streams.read_progress(CIPHER, wire(fields))
    fields["progress_of"] = "0"
    with pytest.raises(MalformedEntry, match="progress_of 0 is out of range"):
        streams.read_progress(CIPHER, wire(fields))
