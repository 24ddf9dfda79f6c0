"""broker.replies: parsers of raw RESP2 replies (bytes, lists, None for nil)."""

from __future__ import annotations

import uuid
from typing import Any

import fakeredis
import pytest

from broker.replies import (
    RAW_COMMANDS,
    Entry,
    Pending,
    PendingSummary,
    parse_xinfo_groups,
    parse_xpending_extended,
    parse_xpending_summary,
    parse_xrange,
    parse_xreadgroup,
)

# -- XREADGROUP ------------------------------------------------------------------------------------


def test_xreadgroup_nil_reply_on_timeout() -> None:
    assert parse_xreadgroup(None) == []
    assert parse_xreadgroup([]) == []


def test_xreadgroup_entries_of_several_streams_in_order() -> None:
    reply = [
        [
            b"deferral:triggers",
            [
                [b"1700000000000-0", [b"trigger_id", b"5", b"classpath", b"a.B"]],
                [b"1700000000000-1", [b"trigger_id", b"6"]],
            ],
        ],
        [b"deferral:queue:default", [[b"1-0", [b"task", b"x"]]]],
    ]
    assert parse_xreadgroup(reply) == [
        Entry("deferral:triggers", "1700000000000-0", {b"trigger_id": b"5", b"classpath": b"a.B"}),
        Entry("deferral:triggers", "1700000000000-1", {b"trigger_id": b"6"}),
        Entry("deferral:queue:default", "1-0", {b"task": b"x"}),
    ]


def test_xreadgroup_nil_field_list_is_a_deleted_entry_with_no_fields() -> None:
    reply = [[b"s", [[b"3-0", None], [b"4-0", [b"k", b"v"]]]]]
    entries = parse_xreadgroup(reply)
    assert entries == [Entry("s", "3-0", {}), Entry("s", "4-0", {b"k": b"v"})]


def test_xreadgroup_keeps_field_values_as_bytes_and_ids_as_str() -> None:
    (entry,) = parse_xreadgroup([[b"s", [[b"1-0", [b"k", b"\xff"]]]]])
    assert isinstance(entry.stream, str)
    assert isinstance(entry.id, str)
    assert entry.fields == {b"k": b"\xff"}


def test_xreadgroup_stream_with_no_entries() -> None:
    assert parse_xreadgroup([[b"s", []]]) == []


def test_odd_field_list_is_refused() -> None:
    with pytest.raises(ValueError):
        parse_xreadgroup([[b"s", [[b"1-0", [b"k", b"v", b"dangling"]]]]])


# -- extended XPENDING ----------------------------------------------------------------------------


def test_xpending_extended() -> None:
    reply = [[b"1-0", b"alice", 1500, 2], [b"2-0", b"bob", 10, 1]]
    assert parse_xpending_extended(reply) == [
        Pending("1-0", "alice", 1500, 2),
        Pending("2-0", "bob", 10, 1),
    ]
    assert parse_xpending_extended([]) == []
    assert parse_xpending_extended(None) == []


# -- XRANGE ----------------------------------------------------------------------------------------


def test_xrange() -> None:
    reply = [[b"1-0", [b"a", b"1"]], [b"2-0", [b"b", b"2", b"c", b"3"]]]
    assert parse_xrange("s", reply) == [
        Entry("s", "1-0", {b"a": b"1"}),
        Entry("s", "2-0", {b"b": b"2", b"c": b"3"}),
    ]
    assert parse_xrange("s", []) == []
    assert parse_xrange("s", None) == []


# -- XPENDING / XINFO GROUPS -----------------------------------------------------------------------


def test_xpending_summary_with_consumers() -> None:
    reply = [5, b"1-0", b"9-0", [[b"alice", b"3"], [b"bob", b"2"]]]
    assert parse_xpending_summary(reply) == PendingSummary(5, {"alice": 3, "bob": 2})


def test_xpending_summary_nil_consumer_list() -> None:
    assert parse_xpending_summary([0, None, None, None]) == PendingSummary(0, {})


def test_xpending_summary_count_as_bytes() -> None:
    assert parse_xpending_summary([b"2", b"1-0", b"2-0", [[b"c", b"2"]]]).count == 2


def test_xinfo_groups_redis7() -> None:
    reply = [
        [
            b"name",
            b"triggerers",
            b"consumers",
            2,
            b"pending",
            3,
            b"last-delivered-id",
            b"5-0",
            b"entries-read",
            5,
            b"lag",
            0,
        ],
        [
            b"name",
            b"other",
            b"consumers",
            0,
            b"pending",
            0,
            b"last-delivered-id",
            b"0-0",
            b"lag",
            None,
        ],
    ]
    assert parse_xinfo_groups(reply) == [
        {
            "name": "triggerers",
            "consumers": 2,
            "pending": 3,
            "last-delivered-id": "5-0",
            "entries-read": 5,
            "lag": 0,
        },
        {"name": "other", "consumers": 0, "pending": 0, "last-delivered-id": "0-0", "lag": None},
    ]


def test_xinfo_groups_empty() -> None:
    assert parse_xinfo_groups([]) == []
    assert parse_xinfo_groups(None) == []


# -- against fakeredis' raw RESP2 replies ----------------------------------------------------------


@pytest.fixture
def raw_redis() -> fakeredis.FakeRedis:
    client = fakeredis.FakeRedis(protocol=2, decode_responses=False)
    for command in RAW_COMMANDS:
        client.response_callbacks.pop(command, None)
    return client


def _xadd(client: fakeredis.FakeRedis, stream: str, **fields: str) -> str:
    flat: list[Any] = [item for pair in fields.items() for item in pair]
    raw = client.execute_command("XADD", stream, "*", *flat)
    return raw.decode() if isinstance(raw, bytes) else str(raw)


def test_fakeredis_xreadgroup_and_xpending_parse(raw_redis: fakeredis.FakeRedis) -> None:
    stream = f"t:{uuid.uuid4().hex}"
    raw_redis.xgroup_create(stream, "g", id="0", mkstream=True)
    first = _xadd(raw_redis, stream, trigger_id="1", task="x")
    second = _xadd(raw_redis, stream, trigger_id="2", task="y")
    reply = raw_redis.execute_command(
        "XREADGROUP", "GROUP", "g", "c1", "COUNT", 10, "STREAMS", stream, ">"
    )
    entries = parse_xreadgroup(reply)
    assert [(e.stream, e.id) for e in entries] == [(stream, first), (stream, second)]
    assert entries[0].fields == {b"trigger_id": b"1", b"task": b"x"}
    summary = parse_xpending_summary(raw_redis.execute_command("XPENDING", stream, "g"))
    assert summary == PendingSummary(2, {"c1": 2})
    empty = raw_redis.execute_command(
        "XREADGROUP", "GROUP", "g", "c1", "COUNT", 10, "STREAMS", stream, ">"
    )
    assert parse_xreadgroup(empty) == []
