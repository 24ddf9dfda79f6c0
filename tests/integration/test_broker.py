"""Broker client against a real Redis: reply shapes (RESP2), consumer groups, the Lua scripts that
retire entries atomically, dead letters, and the raw reply parsers."""

from __future__ import annotations

from typing import Any

import anyio
import pytest

from broker import replies
from broker.client import (
    MIN_REDIS_VERSION,
    AsyncBroker,
    Broker,
    RedisVersionError,
    check_version,
)
from broker.replies import Entry
from broker.streams import EventMessage, QueueMessage, StreamKeys, to_fields
from tests.conftest import REDIS_URL

GROUP = "g"


def _queue(broker: Broker) -> str:
    return broker.keys.queue("default")


def _xlen(broker: Broker, stream: str) -> int:
    return int(broker.redis.xlen(stream))


def _b(fields: dict[str, str]) -> dict[bytes, bytes]:
    return {k.encode(): v.encode() for k, v in fields.items()}


# --- connection and version ------------------------------------------------------------------


def test_client_speaks_resp2(broker: Broker) -> None:
    assert broker.redis.connection_pool.connection_kwargs["protocol"] == 2
    info = broker.redis.execute_command("CLIENT INFO")
    text = str(info) if isinstance(info, dict) else info.decode()
    if "resp" in text:  # Redis >= 7 reports the protocol of the connection
        resp = info["resp"] if isinstance(info, dict) else text.split("resp=")[1][0]
        assert str(resp) == "2"


@pytest.mark.parametrize("version", ["6.2.1", "6.0.20", "5.0.14", b"6.2.0"])
def test_check_version_refuses_old_redis(version: str | bytes) -> None:
    text = version.decode() if isinstance(version, bytes) else version
    with pytest.raises(RedisVersionError, match=f"Redis {text} is too old"):
        check_version({"redis_version": version})


@pytest.mark.parametrize("version", ["6.2.2", "6.2.14", "7.0.15", b"7.2.4"])
def test_check_version_accepts_new_enough(version: str | bytes) -> None:
    check_version({"redis_version": version})


def test_check_version_accepts_the_real_server(broker: Broker) -> None:
    info = broker.redis.info("server")
    check_version(info)
    raw = info["redis_version"]
    text = raw.decode() if isinstance(raw, bytes) else str(raw)
    assert tuple(int(p) for p in text.split(".")[:3]) >= MIN_REDIS_VERSION


# --- groups ----------------------------------------------------------------------------------


def test_ensure_group_is_idempotent_and_creates_stream(broker: Broker) -> None:
    stream = _queue(broker)
    assert broker.redis.exists(stream) == 0
    broker.ensure_group(stream, GROUP)
    broker.ensure_group(stream, GROUP)  # BUSYGROUP swallowed
    assert broker.redis.exists(stream) == 1
    assert _xlen(broker, stream) == 0
    groups = broker.groups(stream)
    assert [g["name"] for g in groups] == [GROUP]
    assert groups[0]["pending"] == 0


def test_group_created_after_entries_reads_them(broker: Broker) -> None:
    stream = _queue(broker)
    ids = [broker.publish(stream, {"n": str(i)}) for i in range(3)]
    broker.ensure_group(stream, GROUP)
    entries = broker.read(GROUP, "c1", {stream: ">"}, count=10)
    assert [e.id for e in entries] == ids
    assert [e.fields for e in entries] == [{b"n": str(i).encode()} for i in range(3)]


def test_groups_on_missing_stream_is_empty(broker: Broker) -> None:
    assert broker.groups(f"{broker.keys.prefix}:nope") == []


# --- read ------------------------------------------------------------------------------------


def test_publish_and_read_new_entries(broker: Broker) -> None:
    stream = _queue(broker)
    broker.ensure_group(stream, GROUP)
    message = QueueMessage(task_instance_id="7", try_number="1", task="d.r.t")
    entry_id = broker.publish(stream, message)
    assert isinstance(entry_id, str) and "-" in entry_id

    entries = broker.read(GROUP, "c1", {stream: ">"}, count=10)
    assert entries == [Entry(stream, entry_id, _b(to_fields(message)))]
    assert all(isinstance(k, bytes) and isinstance(v, bytes) for k, v in entries[0].fields.items())

    # Another consumer of the same group does not get it.
    assert broker.read(GROUP, "c2", {stream: ">"}, count=10) == []
    # Nor does c1 again with ">" ...
    assert broker.read(GROUP, "c1", {stream: ">"}, count=10) == []
    # ... but "0" re-reads its own pending entries, and only its own.
    assert broker.read(GROUP, "c1", {stream: "0"}, count=10) == entries
    assert broker.read(GROUP, "c2", {stream: "0"}, count=10) == []


def test_read_blocks_then_times_out_with_empty_list(broker: Broker) -> None:
    stream = _queue(broker)
    broker.ensure_group(stream, GROUP)
    assert broker.read(GROUP, "c1", {stream: ">"}, count=10, block_ms=50) == []


def test_read_several_streams_at_once(broker: Broker) -> None:
    a, b = broker.keys.queue("a"), broker.keys.queue("b")
    for stream in (a, b):
        broker.ensure_group(stream, GROUP)
    ia = broker.publish(a, {"x": "1"})
    ib = broker.publish(b, {"x": "2"})
    entries = broker.read(GROUP, "c1", {a: ">", b: ">"}, count=10)
    assert {(e.stream, e.id) for e in entries} == {(a, ia), (b, ib)}


def test_read_own_pending_deleted_entry_has_no_fields(broker: Broker) -> None:
    stream = _queue(broker)
    broker.ensure_group(stream, GROUP)
    entry_id = broker.publish(stream, {"x": "1"})
    broker.read(GROUP, "c1", {stream: ">"}, count=10)
    broker.redis.xdel(stream, entry_id)
    assert broker.read(GROUP, "c1", {stream: "0"}, count=10) == [Entry(stream, entry_id, {})]


# --- ack_delete ------------------------------------------------------------------------------


def test_ack_delete_removes_from_pel_and_stream(broker: Broker) -> None:
    stream = _queue(broker)
    broker.ensure_group(stream, GROUP)
    for i in range(3):
        broker.publish(stream, {"n": str(i)})
    entries = broker.read(GROUP, "c1", {stream: ">"}, count=10)
    assert broker.pending(stream, GROUP).count == 3

    assert broker.ack_delete(stream, GROUP, [e.id for e in entries]) == 3
    assert _xlen(broker, stream) == 0
    assert broker.pending(stream, GROUP).count == 0
    assert broker.redis.execute_command("XPENDING", stream, GROUP)[0] == 0  # raw RESP2 reply
    # Again: nothing left to acknowledge.
    assert broker.ack_delete(stream, GROUP, [e.id for e in entries]) == 0


def test_ack_delete_empty_does_not_call_redis(
    broker: Broker, monkeypatch: pytest.MonkeyPatch
) -> None:
    def boom(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("Redis called for an empty id list")

    monkeypatch.setattr(broker, "_ack_delete", boom)
    monkeypatch.setattr(broker.redis, "execute_command", boom)
    assert broker.ack_delete(_queue(broker), GROUP, []) == 0


# --- publish_and_ack / dead_letter ----------------------------------------------------------


def _one_pending(broker: Broker, stream: str, fields: dict[str, str] | None = None) -> Entry:
    broker.ensure_group(stream, GROUP)
    broker.publish(stream, fields or {"x": "1"})
    (entry,) = broker.read(GROUP, "c1", {stream: ">"}, count=10)
    return entry


def test_publish_and_ack_moves_entry(broker: Broker) -> None:
    source, target = broker.keys.triggers, broker.keys.events
    entry = _one_pending(broker, source)
    out = {"trigger_id": "1", "kind": "event"}
    broker.publish_and_ack(entry, GROUP, target, out)

    assert _xlen(broker, source) == 0
    assert broker.pending(source, GROUP).count == 0
    assert [e.fields for e in broker.xrange(target)] == [_b(out)]


def test_publish_and_ack_many_field_pairs(broker: Broker) -> None:
    source, target = broker.keys.triggers, broker.keys.events
    entry = _one_pending(broker, source)
    out = {f"field{i:02d}": f"value{i}" for i in range(50)}
    broker.publish_and_ack(entry, GROUP, target, out)

    (published,) = broker.xrange(target)
    assert published.fields == _b(out)
    assert len(published.fields) == 50
    assert _xlen(broker, source) == 0
    assert broker.pending(source, GROUP).count == 0


def test_dead_letter(broker: Broker) -> None:
    source = broker.keys.triggers
    original = {"trigger_id": "9", "token": "garbage"}
    entry = _one_pending(broker, source, original)
    broker.dead_letter(entry, GROUP, "InvalidToken: bad", deliveries=3)

    assert _xlen(broker, source) == 0
    assert broker.pending(source, GROUP).count == 0
    (dead,) = broker.xrange(broker.keys.dead)
    assert dead.fields == _b(
        {
            **original,
            "source_stream": source,
            "source_id": entry.id,
            "error": "InvalidToken: bad",
            "deliveries": "3",
        }
    )


def test_dead_letter_non_utf8_fields(broker: Broker) -> None:
    source = broker.keys.triggers
    broker.ensure_group(source, GROUP)
    broker.redis.execute_command("XADD", source, "*", b"tok\xffen", b"\xfe\x00\xc3")
    (entry,) = broker.read(GROUP, "c1", {source: ">"}, count=10)
    assert entry.fields == {b"tok\xffen": b"\xfe\x00\xc3"}

    broker.dead_letter(entry, GROUP, "malformed")

    assert _xlen(broker, source) == 0
    assert broker.pending(source, GROUP).count == 0
    (dead,) = broker.xrange(broker.keys.dead)
    assert dead.fields[b"source_id"] == entry.id.encode()
    assert dead.fields[b"error"] == b"malformed"
    assert dead.fields[b"deliveries"] == b"1"
    assert "tok\ufffden".encode() in dead.fields


# --- publish_many / pending ------------------------------------------------------------------


def test_publish_many_several_streams(broker: Broker) -> None:
    a, b = broker.keys.queue("a"), broker.keys.queue("b")
    broker.publish_many([(a, {"n": "1"}), (b, {"n": "2"}), (a, {"n": "3"})])
    assert [e.fields for e in broker.xrange(a)] == [{b"n": b"1"}, {b"n": b"3"}]
    assert [e.fields for e in broker.xrange(b)] == [{b"n": b"2"}]
    broker.publish_many([])  # nothing, no error


def test_xrange_count(broker: Broker) -> None:
    stream = _queue(broker)
    ids = [broker.publish(stream, {"n": str(i)}) for i in range(5)]
    assert [e.id for e in broker.xrange(stream, count=2)] == ids[:2]
    assert broker.xrange(f"{broker.keys.prefix}:missing") == []


def test_pending_summary(broker: Broker) -> None:
    stream = _queue(broker)
    broker.ensure_group(stream, GROUP)
    empty = broker.pending(stream, GROUP)
    assert (empty.count, empty.per_consumer) == (0, {})

    for i in range(5):
        broker.publish(stream, {"n": str(i)})
    broker.read(GROUP, "c1", {stream: ">"}, count=3)
    broker.read(GROUP, "c2", {stream: ">"}, count=10)
    summary = broker.pending(stream, GROUP)
    assert summary.count == 5
    assert summary.per_consumer == {"c1": 3, "c2": 2}
    (group,) = broker.groups(stream)
    assert group["name"] == GROUP and group["consumers"] == 2 and group["pending"] == 5


# --- raw reply parsers on the real server ---------------------------------------------------


def _xautoclaim(broker: Broker, stream: str, consumer: str, start: str, count: int) -> Any:
    return broker.redis.execute_command(
        "XAUTOCLAIM", stream, GROUP, consumer, 0, start, "COUNT", count
    )


def test_parse_xautoclaim_claims_entries(broker: Broker) -> None:
    stream = _queue(broker)
    broker.ensure_group(stream, GROUP)
    ids = [broker.publish(stream, {"n": str(i)}) for i in range(3)]
    broker.read(GROUP, "c1", {stream: ">"}, count=10)

    result = replies.parse_xautoclaim(stream, _xautoclaim(broker, stream, "c2", "0-0", 10))
    assert result.cursor == "0-0"
    assert [e.id for e in result.entries] == ids
    assert [e.fields for e in result.entries] == [{b"n": str(i).encode()} for i in range(3)]
    assert all(e.stream == stream for e in result.entries)
    assert result.deleted_ids == []
    assert broker.pending(stream, GROUP).per_consumer == {"c2": 3}


def test_parse_xautoclaim_reports_deleted_pending_entries(broker: Broker) -> None:
    stream = _queue(broker)
    broker.ensure_group(stream, GROUP)
    ids = [broker.publish(stream, {"n": str(i)}) for i in range(3)]
    broker.read(GROUP, "c1", {stream: ">"}, count=10)
    broker.redis.xdel(stream, ids[1])

    result = replies.parse_xautoclaim(stream, _xautoclaim(broker, stream, "c2", "0-0", 10))
    assert result.cursor == "0-0"
    assert [e.id for e in result.entries] == [ids[0], ids[2]]
    version = broker.redis.info("server")["redis_version"]
    major = int((version.decode() if isinstance(version, bytes) else str(version)).split(".")[0])
    if major >= 7:
        # Redis 7 names the deleted entry and drops it from the PEL; 6.2 returns it as nil.
        assert result.deleted_ids == [ids[1]]
        assert broker.pending(stream, GROUP).count == 2


def test_parse_xautoclaim_pages_with_cursor(broker: Broker) -> None:
    stream = _queue(broker)
    broker.ensure_group(stream, GROUP)
    ids = [broker.publish(stream, {"n": str(i)}) for i in range(5)]
    broker.read(GROUP, "c1", {stream: ">"}, count=10)

    claimed: list[str] = []
    cursor = "0-0"
    for _ in range(10):
        result = replies.parse_xautoclaim(stream, _xautoclaim(broker, stream, "c2", cursor, 2))
        claimed += [e.id for e in result.entries]
        cursor = result.cursor
        if cursor == "0-0":
            break
    assert cursor == "0-0"
    assert claimed == ids


# --- AsyncBroker -----------------------------------------------------------------------------


def test_async_broker(stream_prefix: str, broker: Broker) -> None:
    """``broker`` (same prefix) only cleans the keys up and inspects the streams."""
    keys = StreamKeys(stream_prefix)

    async def main() -> None:
        ab = await AsyncBroker.from_url(REDIS_URL, stream_prefix)
        try:
            assert ab.redis.connection_pool.connection_kwargs["protocol"] == 2
            await ab.ensure_group(keys.triggers, GROUP)
            await ab.ensure_group(keys.triggers, GROUP)
            message = EventMessage(
                trigger_id="1", dedup_key="k", kind="event", payload="{}", triggerer="t"
            )
            await ab.publish(keys.triggers, message)
            await ab.publish(keys.triggers, message)
            await ab.publish(keys.triggers, message)

            entries = await ab.read(GROUP, "c1", {keys.triggers: ">"}, count=10)
            assert len(entries) == 3
            assert all(e.fields == _b(to_fields(message)) for e in entries)
            assert all(e.stream == keys.triggers for e in entries)
            assert await ab.read(GROUP, "c2", {keys.triggers: ">"}, count=10) == []
            assert await ab.read(GROUP, "c1", {keys.triggers: "0"}, count=10) == entries
            assert await ab.read(GROUP, "c1", {keys.triggers: ">"}, count=1, block_ms=20) == []

            many = {f"f{i}": str(i) for i in range(50)}
            await ab.publish_and_ack(entries[0], GROUP, keys.events, many)
            await ab.dead_letter(entries[1], GROUP, "boom", deliveries=2)
        finally:
            await ab.close()

        # Checked with the sync client after the async one is closed.
        (remaining,) = broker.xrange(keys.triggers)
        assert remaining.id == entries[2].id
        assert broker.pending(keys.triggers, GROUP).count == 1
        (event,) = broker.xrange(keys.events)
        assert event.fields == _b(many)
        (dead,) = broker.xrange(keys.dead)
        assert dead.fields == _b(
            {
                **to_fields(message),
                "source_stream": keys.triggers,
                "source_id": entries[1].id,
                "error": "boom",
                "deliveries": "2",
            }
        )

    anyio.run(main)


def test_async_broker_waits_for_a_connection_rather_than_failing(
    stream_prefix: str, broker: Broker
) -> None:
    """Many triggers firing at once share a small pool: every publish gets through."""
    source, target, group = f"{stream_prefix}:src", f"{stream_prefix}:dst", "g"
    broker.ensure_group(source, group)
    for i in range(60):
        broker.publish(source, {"n": str(i)})
    entries = broker.read(group, "c", {source: ">"}, count=100)

    async def burst() -> None:
        client = await AsyncBroker.from_url(REDIS_URL, stream_prefix, max_connections=2)
        async with anyio.create_task_group() as tasks:
            for entry in entries:
                tasks.start_soon(client.publish_and_ack, entry, group, target, {"ok": "1"})
        await client.close()

    anyio.run(burst)
    assert _xlen(broker, target) == 60
    assert _xlen(broker, source) == 0


# --- leases (AsyncBroker.renew / autoclaim / hand_off) ---------------------------------------


def _pending_detail(broker: Broker, stream: str, group: str) -> dict[str, tuple[str, int, int]]:
    """id -> (owner, idle ms, deliveries), from extended XPENDING."""
    reply = broker.redis.execute_command("XPENDING", stream, group, "-", "+", 100)
    return {i.decode(): (c.decode(), int(idle), int(n)) for i, c, idle, n in reply}


def test_renew_keeps_own_entries_and_never_steals_one_taken_over(
    stream_prefix: str, broker: Broker
) -> None:
    stream, group = f"{stream_prefix}:leases", "g"
    broker.ensure_group(stream, group)
    for i in range(3):
        broker.publish(stream, {"n": str(i)})
    ids = [e.id for e in broker.read(group, "me", {stream: ">"}, count=10)]
    # A peer took the last entry over.
    broker.redis.execute_command("XCLAIM", stream, group, "peer", 0, ids[2], "JUSTID")
    broker.redis.execute_command(
        "XCLAIM", stream, group, "me", 0, *ids[:2], "IDLE", 50_000, "JUSTID"
    )

    async def renew() -> list[str]:
        client = await AsyncBroker.from_url(REDIS_URL, stream_prefix)
        owned = await client.renew(stream, group, "me", ids)
        await client.close()
        return owned

    assert anyio.run(renew) == ids[:2]
    detail = _pending_detail(broker, stream, group)
    assert detail[ids[2]][0] == "peer"  # not stolen back
    for entry_id in ids[:2]:
        owner, idle, deliveries = detail[entry_id]
        assert owner == "me" and idle < 5_000 and deliveries == 1  # renewed, not re-delivered


def test_autoclaim_takes_only_long_idle_entries_and_hand_off_makes_them_so(
    stream_prefix: str, broker: Broker
) -> None:
    stream, group = f"{stream_prefix}:leases", "g"
    broker.ensure_group(stream, group)
    for i in range(25):
        broker.publish(stream, {"n": str(i)})
    ids = [e.id for e in broker.read(group, "leaving", {stream: ">"}, count=100)]

    async def scenario() -> tuple[list[Entry], list[str], list[Entry]]:
        client = await AsyncBroker.from_url(REDIS_URL, stream_prefix)
        before = await client.autoclaim(stream, group, "peer", min_idle_ms=60_000, count=100)
        pending = await client.pending_ids(stream, group, "leaving")
        await client.hand_off(stream, group, "leaving", pending, idle_ms=120_000)
        after = await client.autoclaim(stream, group, "peer", min_idle_ms=60_000, count=100)
        await client.close()
        return before, pending, after

    before, pending, after = anyio.run(scenario)
    assert before == [] and pending == ids
    assert [e.id for e in after] == ids
    assert {owner for owner, _, _ in _pending_detail(broker, stream, group).values()} == {"peer"}
