"""Broker client against a real Redis: reply shapes (RESP2), consumer groups, the Lua scripts that
retire entries atomically, dead letters, and the raw reply parsers."""

from __future__ import annotations

import msgspec
import pytest

from broker import client, replies
from broker.client import (
    MIN_REDIS_VERSION,
    Broker,
    LeaseStatus,
    RedisVersionError,
    check_version,
)
from broker.replies import Entry
from broker.streams import (
    DeadEntry,
    DeadLetterMessage,
    QueueMessage,
    dead_letter_verified,
    from_fields,
    to_fields,
)
from deferral.runtime.crypto import Cipher, Purpose
from tests.helpers import wait_for

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
    message = QueueMessage(task_instance_id="7", try_number="1", task="d.r.t", mac="m")
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


# --- publishing with the in-flight index ----------------------------------------------------


def test_publish_records_work_in_the_in_flight_index(broker: Broker) -> None:
    keys = broker.keys
    entry_id = broker.publish(keys.triggers, {"trigger_id": "12", "token": "t"})
    assert broker.redis.hget(keys.inflight(keys.triggers), "12") == entry_id.encode()
    # A republish of the same work moves the index to the newer entry.
    newer = broker.publish(keys.triggers, {"trigger_id": "12", "token": "t"})
    assert broker.redis.hget(keys.inflight(keys.triggers), "12") == newer.encode()
    # Streams that carry no work are not indexed.
    broker.publish(keys.dead, {"trigger_id": "12"})
    assert not broker.redis.exists(keys.inflight(keys.dead))


def test_publish_many_several_streams(broker: Broker) -> None:
    a, b = broker.keys.queue("a"), broker.keys.queue("b")
    broker.publish_many(
        [(a, {"task_instance_id": "1"}), (b, {"task_instance_id": "2"}), (a, {"n": "3"})]
    )
    assert [e.fields for e in broker.xrange(a)] == [{b"task_instance_id": b"1"}, {b"n": b"3"}]
    assert [e.fields for e in broker.xrange(b)] == [{b"task_instance_id": b"2"}]
    assert broker.present(a, ["1", "2"]) == {"1": True, "2": False}
    broker.publish_many([])  # nothing, no error


def _no_pipeline(*args: object, **kwargs: object) -> None:
    raise AssertionError("a pipeline asks SCRIPT EXISTS first: a round trip more")


def test_one_entry_is_published_and_handed_on_without_a_pipeline(
    broker: Broker, monkeypatch: pytest.MonkeyPatch
) -> None:
    keys = broker.keys
    monkeypatch.setattr(broker.redis, "pipeline", _no_pipeline)
    broker.publish_many([(keys.triggers, {"trigger_id": "7", "token": "t"})])
    (entry,) = _read_all(broker, keys.triggers)
    broker.hand_on_many(GROUP, [(entry, keys.events, {"trigger_id": "7"})])
    assert broker.present(keys.triggers, ["7"]) == {"7": False}
    assert broker.present(keys.events, ["7"]) == {"7": True}


def test_present_needs_the_entry_itself(broker: Broker) -> None:
    stream = broker.keys.triggers
    entry_id = broker.publish(stream, {"trigger_id": "5"})
    assert broker.present(stream, ["5", "6"]) == {"5": True, "6": False}
    broker.redis.xdel(stream, entry_id)  # lost, though the index still names it
    assert broker.present(stream, ["5"]) == {"5": False}


# --- retire / hand on / dead letter ----------------------------------------------------------


def _read_all(broker: Broker, stream: str, consumer: str = "c1") -> list[Entry]:
    broker.ensure_group(stream, GROUP)
    return broker.read(GROUP, consumer, {stream: ">"}, count=10_000)


def test_retire_acks_deletes_and_clears_the_index(broker: Broker) -> None:
    stream = broker.keys.queue("default")
    for i in range(3):
        broker.publish(stream, {"task_instance_id": str(i)})
    entries = _read_all(broker, stream)
    assert broker.pending(stream, GROUP).count == 3
    assert broker.retire(GROUP, entries) == 3
    assert _xlen(broker, stream) == 0
    assert broker.pending(stream, GROUP).count == 0
    assert not broker.redis.exists(broker.keys.inflight(stream))
    assert broker.retire(GROUP, entries) == 0  # again: nothing, no error


def test_retiring_an_older_entry_keeps_the_index_of_a_newer_one(broker: Broker) -> None:
    stream = broker.keys.triggers
    broker.publish(stream, {"trigger_id": "9"})
    older = _read_all(broker, stream)
    newer_id = broker.publish(stream, {"trigger_id": "9"})
    broker.retire(GROUP, older)
    assert broker.present(stream, ["9"]) == {"9": True}
    assert broker.redis.hget(broker.keys.inflight(stream), "9") == newer_id.encode()


def test_hand_on_moves_an_entry_and_its_index(broker: Broker) -> None:
    keys = broker.keys
    broker.publish(keys.triggers, {"trigger_id": "3", "token": "x"})
    (entry,) = _read_all(broker, keys.triggers)
    out = {"trigger_id": "3", "kind": "event", "payload": "[" + "1," * 200 + "1]"}
    event_id = broker.hand_on(entry, GROUP, keys.events, out)
    assert _xlen(broker, keys.triggers) == 0
    assert broker.pending(keys.triggers, GROUP).count == 0
    (published,) = broker.xrange(keys.events)
    assert (published.id, published.fields) == (event_id, _b(out))
    assert broker.present(keys.triggers, ["3"]) == {"3": False}
    assert broker.present(keys.events, ["3"]) == {"3": True}


def test_hand_on_many_in_one_round_trip(broker: Broker) -> None:
    keys = broker.keys
    for i in range(5):
        broker.publish(keys.triggers, {"trigger_id": str(i)})
    entries = _read_all(broker, keys.triggers)
    broker.hand_on_many(
        GROUP, [(e, keys.events, {"trigger_id": e.fields[b"trigger_id"].decode()}) for e in entries]
    )
    assert _xlen(broker, keys.triggers) == 0
    assert _xlen(broker, keys.events) == 5


def _dead_letter(broker: Broker, cipher: Cipher, entry: Entry, error: str, **kw: int) -> None:
    broker.dead_letter(entry, GROUP, error, cipher=cipher, consumer="c1", **kw)


def test_dead_letter_keeps_where_why_and_how_often_in_clear_and_the_entry_sealed(
    broker: Broker, cipher: Cipher
) -> None:
    keys = broker.keys
    source = keys.queue("default")
    broker.publish(source, {"task_instance_id": "1", "try_number": "1", "task": "d.r.t"})
    (entry,) = _read_all(broker, source)
    _dead_letter(
        broker, cipher, entry, "bad queue entry: forged\nTraceback (most recent)", deliveries=3
    )
    assert _xlen(broker, source) == 0
    assert broker.pending(source, GROUP).count == 0
    assert broker.present(source, ["1"]) == {"1": False}
    (dead,) = broker.xrange(keys.dead)
    assert dead_letter_verified(cipher, from_fields(DeadLetterMessage, dead.fields))
    sealed = dead.fields.pop(b"sealed")
    assert len(dead.fields.pop(b"mac")) == 43  # authenticates every other field
    assert dead.fields == {
        b"source_stream": source.encode(),
        b"source_id": entry.id.encode(),
        b"error": b"bad queue entry: forged\\nTraceback (most recent)",
        b"deliveries": b"3",
        b"task": b"d.r.t",
        b"consumer": b"c1",
    }
    original = msgspec.json.decode(cipher.decrypt(Purpose.DEAD_LETTER, sealed), type=DeadEntry)
    assert original == DeadEntry(
        source,
        entry.id,
        {"task_instance_id": "1", "try_number": "1", "task": "d.r.t"},
        "bad queue entry: forged\\nTraceback (most recent)",
        3,
    )


def test_dead_letter_of_undecodable_bytes_is_still_written(broker: Broker, cipher: Cipher) -> None:
    source = broker.keys.queue("default")
    broker.publish(source, {"x": "1"})
    (entry,) = _read_all(broker, source)
    broken = Entry(entry.stream, entry.id, {b"\xff": b"\xfe\xff"})
    _dead_letter(broker, cipher, broken, "malformed")
    (dead,) = broker.xrange(broker.keys.dead)
    assert dead.fields[b"error"] == b"malformed"


@pytest.mark.parametrize(
    ("fields", "said"),
    [
        ({f"f{i}": "v" for i in range(5000)}, b"entry of 5000 fields and"),
        ({"task": "d.r.t", "blob": "x" * 10_000_000}, b"entry of 2 fields and 10000"),
    ],
    ids=["5000 fields", "a 10 MB field"],
)
def test_dead_letter_of_a_huge_entry_is_small_and_retires_it(
    broker: Broker, cipher: Cipher, fields: dict[str, str], said: bytes
) -> None:
    """The entry's own fields never reach the Lua call's arguments (Lua's stack ends near
    8,000 values) nor the dead-letter stream."""
    source = broker.keys.queue("default")
    broker.ensure_group(source, GROUP)
    broker.redis.execute_command("XADD", source, "*", *[x for kv in fields.items() for x in kv])
    (entry,) = _read_all(broker, source)
    _dead_letter(broker, cipher, entry, "x" * 5000)
    assert _xlen(broker, source) == 0
    (dead,) = broker.xrange(broker.keys.dead)
    assert dead.fields[b"sealed"] == b""
    assert said in dead.fields[b"error"]
    assert sum(len(k) + len(v) for k, v in dead.fields.items()) < 2_000


def test_dead_letters_are_trimmed_to_about_their_bound(broker: Broker, cipher: Cipher) -> None:
    source = broker.keys.queue("default")
    broker.ensure_group(source, GROUP)
    for i in range(1_000):
        broker.redis.execute_command("XADD", source, "*", "n", str(i))
    for entry in _read_all(broker, source):
        _dead_letter(broker, cipher, entry, "flood", maxlen=100)
    # MAXLEN ~ trims whole macro nodes (100 entries each by default): about the bound, not exact.
    assert 100 <= _xlen(broker, broker.keys.dead) <= 300
    assert _xlen(broker, source) == 0


# --- pending ---------------------------------------------------------------------------------


def test_xrange_with_count(broker: Broker) -> None:
    stream = _queue(broker)
    ids = [broker.publish(stream, {"n": str(i)}) for i in range(3)]
    assert [e.id for e in broker.xrange(stream, count=2)] == ids[:2]
    assert broker.xrange(f"{broker.keys.prefix}:missing") == []


def test_pending_summary_and_groups(broker: Broker) -> None:
    stream = _queue(broker)
    broker.ensure_group(stream, GROUP)
    empty = broker.pending(stream, GROUP)
    assert (empty.count, empty.per_consumer) == (0, {})
    for i in range(3):
        broker.publish(stream, {"n": str(i)})
    broker.read(GROUP, "c1", {stream: ">"}, count=2)
    broker.read(GROUP, "c2", {stream: ">"}, count=2)
    summary = broker.pending(stream, GROUP)
    assert (summary.count, summary.per_consumer) == (3, {"c1": 2, "c2": 1})
    (group,) = broker.groups(stream)
    assert group["pending"] == 3


# --- leases ----------------------------------------------------------------------------------


def _held(broker: Broker, n: int, consumer: str = "me") -> tuple[str, list[str]]:
    stream = _queue(broker)
    for i in range(n):
        broker.publish(stream, {"task_instance_id": str(i + 1)})
    return stream, [e.id for e in _read_all(broker, stream, consumer)]


def _deliveries(broker: Broker, stream: str, entry_id: str) -> int:
    (item,) = replies.parse_xpending_extended(
        broker.redis.execute_command("XPENDING", stream, GROUP, entry_id, entry_id, 1)
    )
    return item.deliveries


def test_renew_says_owned_taken_or_gone(broker: Broker) -> None:
    stream, ids = _held(broker, 3)
    broker.redis.execute_command("XCLAIM", stream, GROUP, "peer", 0, ids[1], "JUSTID")
    broker.retire(GROUP, [Entry(stream, ids[2], {})])
    status = broker.renew(stream, GROUP, "me", ids)
    assert status == {
        ids[0]: LeaseStatus.OWNED,
        ids[1]: LeaseStatus.TAKEN,
        ids[2]: LeaseStatus.GONE,
    }
    # Renewal never steals a taken entry back.
    assert broker.own_pending(stream, GROUP, "peer")[0].id == ids[1]


def test_renew_resets_idle_and_proves_the_survivors(broker: Broker) -> None:
    stream, ids = _held(broker, 2)
    broker.mark_started(stream, ids)
    broker.renew(stream, GROUP, "me", ids, survivors=[ids[0]])
    assert broker.started_counts(stream, ids) == {ids[1]: 0}  # the survivor is no suspect
    assert all(p.idle_ms < 1000 for p in broker.own_pending(stream, GROUP, "me"))


def test_retiring_or_handing_on_an_entry_deletes_its_start_evidence(broker: Broker) -> None:
    stream, ids = _held(broker, 3)
    broker.mark_started(stream, ids)
    entries = [Entry(stream, i, {b"task_instance_id": b"1"}) for i in ids]
    broker.retire(GROUP, entries[:1])
    broker.hand_on(entries[1], GROUP, broker.keys.dead, {"error": "x"})
    assert broker.started_counts(stream, ids) == {ids[2]: 0}


def _pending(broker: Broker, stream: str, entry_id: str) -> replies.Pending:
    return broker.owners_of(stream, GROUP, [entry_id])[entry_id]


def test_one_suspect_claim_per_stream_counts_its_deliveries(broker: Broker) -> None:
    stream, ids = _held(broker, 3, consumer="dead")
    broker.mark_started(stream, ids[:2])
    first = broker.take_suspect(
        stream, GROUP, "a", _pending(broker, stream, ids[0]), min_idle_ms=0, lease_ms=10_000
    )
    assert first.claimed is not None and first.claimed.entry.id == ids[0]
    assert (first.claimed.owner, first.claimed.deliveries) == ("dead", 1)
    assert broker.suspect_holder(stream) == "a"
    # Another consumer waits while the first suspect has not proven itself...
    busy = broker.take_suspect(
        stream, GROUP, "b", _pending(broker, stream, ids[1]), min_idle_ms=0, lease_ms=10_000
    )
    assert (busy.claimed, busy.busy) == (None, "a")
    # ... but a process restarted under the holder's name takes it at once (its predecessor
    # died running the suspect, whose count stays).
    again = broker.take_suspect(
        stream, GROUP, "a", _pending(broker, stream, ids[1]), min_idle_ms=0, lease_ms=10_000
    )
    assert again.claimed is not None and again.claimed.deliveries == 1
    # Once the running suspect survived a heartbeat, the claim is free.
    broker.renew(stream, GROUP, "a", [ids[1]], survivors=[ids[1]], suspect=ids[1], lease_ms=1)
    assert broker.suspect_holder(stream) == ""
    # An entry that never started is no suspect; one that moved is not taken.
    never = broker.take_suspect(
        stream, GROUP, "b", _pending(broker, stream, ids[2]), min_idle_ms=0, lease_ms=10_000
    )
    assert never == client.SuspectTaken(None, "")
    assert broker.started_counts(stream, ids) == {ids[0]: 1}
    moved = _pending(broker, stream, ids[0])
    broker.redis.execute_command("XCLAIM", stream, GROUP, "peer", 0, ids[0], "JUSTID")
    assert broker.take_suspect(stream, GROUP, "b", moved, min_idle_ms=0, lease_ms=10_000) == (
        client.SuspectTaken(None, "")
    )


def test_a_suspect_claim_of_a_dead_holder_expires_with_its_lease(broker: Broker) -> None:
    stream, ids = _held(broker, 2, consumer="dead")
    broker.mark_started(stream, ids)
    take = broker.take_suspect
    assert take(stream, GROUP, "a", _pending(broker, stream, ids[0]), min_idle_ms=0, lease_ms=50)
    assert broker.suspect_holder(stream) == "a"
    broker.redis.execute_command("PEXPIRE", broker.keys.suspect(stream), 1)
    wait_for(lambda: broker.suspect_holder(stream) == "", timeout=5, what="the claim to expire")
    taken = take(stream, GROUP, "b", _pending(broker, stream, ids[1]), min_idle_ms=0, lease_ms=50)
    assert taken.claimed is not None and taken.claimed.deliveries == 1


def test_renew_many_ids_in_batches(broker: Broker) -> None:
    stream, ids = _held(broker, 2500)
    status = broker.renew(stream, GROUP, "me", ids)
    assert len(status) == 2500 and set(status.values()) == {LeaseStatus.OWNED}


def test_claim_idle_takes_only_long_idle_entries_with_owner_and_count(broker: Broker) -> None:
    stream, ids = _held(broker, 2, consumer="dead")
    assert broker.claim_idle(stream, GROUP, "me", min_idle_ms=60_000, count=10) == []
    broker.hand_off(stream, GROUP, "dead", ids, idle_ms=120_000)
    claimed = broker.claim_idle(stream, GROUP, "me", min_idle_ms=60_000, count=10)
    assert [(c.entry.id, c.owner, c.deliveries) for c in claimed] == [
        (ids[0], "dead", 1),
        (ids[1], "dead", 1),
    ]
    assert claimed[0].entry.fields == {b"task_instance_id": b"1"}
    assert {p.consumer for p in broker.own_pending(stream, GROUP, "me")} == {"me"}
    assert _deliveries(broker, stream, ids[0]) == 2


def test_own_pending_between_ids(broker: Broker) -> None:
    stream, ids = _held(broker, 4)
    assert [p.id for p in broker.own_pending(stream, GROUP, "me", start=ids[1], end=ids[2])] == ids[
        1:3
    ]


def test_pending_pages_are_bounded_and_all_own_pending_reads_them_all(
    broker: Broker, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(client, "PENDING_PAGE", 3)
    stream, ids = _held(broker, 7)
    assert len(broker.own_pending(stream, GROUP, "me")) == 3
    assert [p.id for p in broker.all_own_pending(stream, GROUP, "me")] == ids
    broker.hand_off(stream, GROUP, "me", ids, idle_ms=120_000)
    first = broker.idle_pending(stream, GROUP, min_idle_ms=60_000, count=100)
    assert [p.id for p in first] == ids[:3]
    after = broker.idle_pending(stream, GROUP, min_idle_ms=60_000, count=100, after=ids[2])
    assert [p.id for p in after] == ids[3:6]


def test_reclaim_takes_back_only_from_the_name_it_was_found_under(broker: Broker) -> None:
    stream, ids = _held(broker, 2)
    for entry_id in ids:
        broker.redis.execute_command(
            "XCLAIM", stream, GROUP, "x", 0, entry_id, "RETRYCOUNT", 10, "IDLE", 3_600_000
        )
    # A peer took the second one over from x in between: it keeps it.
    broker.redis.execute_command("XCLAIM", stream, GROUP, "peer", 0, ids[1], "JUSTID")
    found = broker.owners_of(stream, GROUP, ids)
    assert {i: (p.consumer, p.deliveries) for i, p in found.items()} == {
        ids[0]: ("x", 10),
        ids[1]: ("peer", 10),
    }
    assert broker.reclaim(stream, GROUP, "me", [(ids[0], "x"), (ids[1], "x")]) == [ids[0]]
    assert [p.id for p in broker.all_own_pending(stream, GROUP, "me")] == [ids[0]]


def test_delete_idle_consumers_spares_those_with_pending_entries(broker: Broker) -> None:
    stream, _ = _held(broker, 1, consumer="busy")
    broker.redis.execute_command("XGROUP", "CREATECONSUMER", stream, GROUP, "idle")
    assert broker.consumers(stream, GROUP) == {"busy": 1, "idle": 0}
    assert broker.delete_idle_consumers(stream, GROUP, ["busy", "idle", "never"]) == [
        "idle",
        "never",
    ]
    assert broker.consumers(stream, GROUP) == {"busy": 1}
    assert broker.consumers("no-such-stream", GROUP) == {}
