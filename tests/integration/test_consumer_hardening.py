"""The consumer core against real Redis and PostgreSQL: entries of any shape, forged delivery
counts, suspects replayed one at a time after a restart under the same name, and consumers of
stopped processes removed from their groups."""

from __future__ import annotations

import datetime as dt
import logging
import time
from typing import Any

import pytest
from sqlalchemy import delete
from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import Session, sessionmaker

from broker.client import Broker, LeaseStatus
from broker.consumer import StreamConsumer
from broker.owners import PostgresOwners
from broker.replies import Entry
from deferral.runtime.crypto import Cipher
from deferral.store.tables import Triggerer
from tests.helpers import wait_for

GROUP = "g"
HB = 0.2  # heartbeat, seconds


def _row(sessions: sessionmaker[Session], name: str, *, state: str, age_sec: float) -> None:
    """The triggerer row of ``name``: its state and how old its last heartbeat is."""
    beat = dt.datetime.now(dt.UTC) - dt.timedelta(seconds=age_sec)
    with sessions.begin() as session:
        session.execute(delete(Triggerer).where(Triggerer.name == name))
        session.add(
            Triggerer(
                name=name,
                hostname="h",
                pid=1,
                capacity=10,
                state=state,
                latest_heartbeat=beat,
            )
        )


def _consumer(
    broker: Broker,
    cipher: Cipher,
    sessions: sessionmaker[Session],
    name: str,
    *,
    max_deliveries: int = 3,
    starts_on_admit: bool = True,
) -> StreamConsumer:
    consumer = StreamConsumer(
        broker,
        broker.keys.triggers,
        GROUP,
        name,
        heartbeat_sec=HB,
        max_deliveries=max_deliveries,
        cipher=cipher,
        dead_letter_maxlen=50,
        owners=PostgresOwners(sessions, Triggerer),
        starts_on_admit=starts_on_admit,
    )
    consumer.start()
    return consumer


def _publish(broker: Broker, n: int) -> list[str]:
    return [broker.publish(broker.keys.triggers, {"trigger_id": str(i)}) for i in range(n)]


def _dead(broker: Broker) -> list[tuple[str, str]]:
    return [
        (e.fields[b"source_id"].decode(), e.fields[b"error"].decode())
        for e in broker.xrange(broker.keys.dead)
    ]


# -- entries of any shape ---------------------------------------------------------------------


def test_entries_over_the_limits_are_dead_lettered_before_the_service_sees_them(
    broker: Broker, cipher: Cipher, sessions: sessionmaker[Session]
) -> None:
    stream = broker.keys.triggers
    before = _publish(broker, 1)
    wide = broker.redis.xadd(stream, {f"f{i}": "v" for i in range(4000)}).decode()
    huge = broker.redis.xadd(stream, {"payload": b"x" * (10 * 1024 * 1024)}).decode()
    after = _publish(broker, 1)
    consumer = _consumer(broker, cipher, sessions, "t1")
    delivered = consumer.poll(10)
    assert [d.entry.id for d in delivered] == before + after
    assert consumer.held == 2
    dead = dict(_dead(broker))
    assert dead[wide].endswith("entry of 4000 fields is over the limit of 16 fields")
    assert dead[huge].endswith("entry of 10485767 bytes is over the limit of 4194304 bytes")
    assert int(broker.redis.xlen(stream)) == 2  # both retired with their dead letters


def test_the_bad_entries_of_a_read_are_dead_lettered_in_one_round_trip(
    broker: Broker,
    cipher: Cipher,
    sessions: sessionmaker[Session],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    stream = broker.keys.triggers
    for i in range(40):
        broker.redis.execute_command("XADD", stream, "*", "junk", str(i))
    consumer = _consumer(broker, cipher, sessions, "t1")
    read = consumer.poll(100)
    assert len(read) == 40
    round_trips: list[str] = []
    monkeypatch.setattr(
        broker.redis, "execute_command", lambda *a, **k: round_trips.append(str(a[0]))
    )
    pipeline = broker.redis.pipeline
    monkeypatch.setattr(
        broker.redis, "pipeline", lambda **k: round_trips.append("pipeline") or pipeline(**k)
    )
    assert consumer.dead_letter_many([(d, "bad trigger entry: junk") for d in read])
    monkeypatch.undo()
    assert round_trips == ["pipeline"]
    assert int(broker.redis.xlen(broker.keys.dead)) == 40 and int(broker.redis.xlen(stream)) == 0
    assert not any(consumer.holds(d.entry.id) for d in read)


def test_a_failure_to_dead_letter_is_logged_and_never_raised(
    broker: Broker,
    cipher: Cipher,
    sessions: sessionmaker[Session],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    _publish(broker, 1)
    consumer = _consumer(broker, cipher, sessions, "t1")
    (delivery,) = consumer.poll(1)

    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("Lua stack overflow")

    monkeypatch.setattr(broker, "dead_letter_many", broken)
    with caplog.at_level(logging.ERROR, "deferral.broker"):
        assert consumer.dead_letter(delivery, "bad entry") is False
    assert "could not dead-letter" in caplog.text and "Lua stack overflow" in caplog.text
    assert not consumer.holds(delivery.entry.id)  # released: taken over and retried later


def test_a_held_entry_deleted_under_the_consumer_is_dropped(
    broker: Broker, cipher: Cipher, sessions: sessionmaker[Session]
) -> None:
    (entry_id,) = _publish(broker, 1)
    consumer = _consumer(broker, cipher, sessions, "t1")
    consumer.poll(1)
    broker.redis.xdel(broker.keys.triggers, entry_id)
    broker.redis.execute_command("XACK", broker.keys.triggers, GROUP, entry_id)
    (lost,) = consumer.renew()
    assert lost.entry_id == entry_id and not consumer.holds(entry_id)


# -- forged delivery counts -------------------------------------------------------------------


def _set_holder(broker: Broker, entry_id: str, holder: str, count: int, idle_ms: int) -> None:
    """What anyone with Redis write access can do: say who holds an entry, how many deliveries
    are counted against it (its start evidence) and for how long it has been idle."""
    broker.redis.execute_command(
        "XCLAIM", broker.keys.triggers, GROUP, holder, 0, entry_id, "IDLE", idle_ms, "JUSTID"
    )
    broker.redis.hset(broker.keys.started(broker.keys.triggers), entry_id, count)


def _forge(broker: Broker, entry_id: str) -> None:
    _set_holder(broker, entry_id, "x", 10, 3_600_000)


def _delivered_to(broker: Broker, holder: str) -> str:
    """A new entry, read by ``holder``."""
    (entry_id,) = _publish(broker, 1)
    broker.ensure_group(broker.keys.triggers, GROUP)
    broker.read(GROUP, holder, {broker.keys.triggers: ">"}, count=1)
    return entry_id


def test_a_held_entry_claimed_by_an_unregistered_name_is_taken_back(
    broker: Broker,
    cipher: Cipher,
    sessions: sessionmaker[Session],
    caplog: pytest.LogCaptureFixture,
) -> None:
    (entry_id,) = _publish(broker, 1)
    _row(sessions, "t1", state="running", age_sec=0)
    consumer = _consumer(broker, cipher, sessions, "t1")
    consumer.poll(1)
    _forge(broker, entry_id)
    with caplog.at_level(logging.WARNING, "deferral.broker"):
        assert consumer.renew() == []
    assert consumer.holds(entry_id)
    (item,) = broker.owners_of(broker.keys.triggers, GROUP, [entry_id]).values()
    assert item.consumer == "t1"
    assert "not a registered consumer, e.g. " + entry_id + " by 'x'" in caplog.text


def test_a_forged_count_on_an_idle_entry_is_ignored_and_logged(
    broker: Broker,
    cipher: Cipher,
    sessions: sessionmaker[Session],
    caplog: pytest.LogCaptureFixture,
) -> None:
    entry_id = _delivered_to(broker, "x")
    _forge(broker, entry_id)
    _row(sessions, "t2", state="running", age_sec=0)
    peer = _consumer(broker, cipher, sessions, "t2")
    # Left two heartbeats first: a live holder would take it back meanwhile.
    assert peer.claim(10) == []
    with caplog.at_level(logging.WARNING, "deferral.broker"):
        claimed = wait_for(lambda: peer.claim(10), timeout=10, what="the takeover")
    assert [(d.entry.id, d.deliveries, d.taken_from) for d in claimed] == [(entry_id, 1, "x")]
    assert not peer.exhausted(claimed[0])
    assert "ignoring the start evidence" in caplog.text and "(count 10)" in caplog.text


def test_a_count_on_a_live_consumers_name_is_ignored(
    broker: Broker, cipher: Cipher, sessions: sessionmaker[Session]
) -> None:
    entry_id = _delivered_to(broker, "t1")
    _set_holder(broker, entry_id, "t1", 10, 3_600_000)
    _row(sessions, "t1", state="running", age_sec=0)  # alive: it did not die holding it
    _row(sessions, "t2", state="running", age_sec=0)
    peer = _consumer(broker, cipher, sessions, "t2")
    (delivery,) = peer.claim(10)
    assert (delivery.deliveries, delivery.suspect) == (1, False)
    assert not peer.exhausted(delivery)


def test_a_dead_registered_consumers_count_is_believed(
    broker: Broker, cipher: Cipher, sessions: sessionmaker[Session]
) -> None:
    entry_id = _delivered_to(broker, "t1")
    _set_holder(broker, entry_id, "t1", 3, 10_000)
    _row(sessions, "t1", state="running", age_sec=10)  # died holding it
    _row(sessions, "t2", state="running", age_sec=0)
    peer = _consumer(broker, cipher, sessions, "t2")
    (delivery,) = peer.claim(10)
    assert delivery.deliveries == 4 and peer.exhausted(delivery)


# -- suspects one at a time on replay ---------------------------------------------------------


def _survive_a_heartbeat(consumer: StreamConsumer) -> None:
    time.sleep(HB * 1.1)
    assert consumer.renew() == []


def _evidence(broker: Broker, ids: list[str]) -> dict[str, int]:
    return broker.started_counts(broker.keys.triggers, ids)


def test_a_restart_under_the_same_name_replays_suspects_one_at_a_time(
    broker: Broker, cipher: Cipher, sessions: sessionmaker[Session]
) -> None:
    """Process 1 starts 4 entries and runs two a heartbeat (one is kept past it), then starts
    two more and dies within the heartbeat. Process 2 replays the two survivors together and
    only then the suspects, one at a time, each once everything it runs has run a heartbeat."""
    ids = _publish(broker, 4)
    _row(sessions, "t1", state="running", age_sec=0)
    first = _consumer(broker, cipher, sessions, "t1")
    first.poll(2)
    _survive_a_heartbeat(first)
    first.poll(2)  # then it dies, before these two ran a heartbeat
    assert _evidence(broker, ids) == {ids[2]: 0, ids[3]: 0}

    second = _consumer(broker, cipher, sessions, "t1")  # same name, row still "running"
    replayed = second.poll(10)
    assert [(d.entry.id, d.deliveries, d.suspect) for d in replayed] == [
        (ids[0], 1, False),
        (ids[1], 1, False),
    ]
    assert second.poll(10, block_ms=10) == []  # the survivors have not yet proven themselves
    _survive_a_heartbeat(second)
    (suspect,) = second.poll(10)
    assert (suspect.entry.id, suspect.deliveries, suspect.suspect) == (ids[2], 1, True)
    assert broker.suspect_holder(broker.keys.triggers) == "t1"
    assert second.poll(10, block_ms=10) == []
    _survive_a_heartbeat(second)
    (suspect,) = second.poll(10)
    assert (suspect.entry.id, suspect.deliveries) == (ids[3], 1)
    _survive_a_heartbeat(second)
    new = _publish(broker, 1)
    assert [d.entry.id for d in second.poll(10)] == new  # replay over: new entries again
    assert _evidence(broker, ids) == {}


def test_an_entry_delivered_but_never_started_is_no_suspect(
    broker: Broker, cipher: Cipher, sessions: sessionmaker[Session]
) -> None:
    """A service that starts what it reads itself (the triggerer: a timer runs no code) writes
    evidence only for what it starts: the others come back together after a restart."""
    ids = _publish(broker, 3)
    _row(sessions, "t1", state="running", age_sec=0)
    first = _consumer(broker, cipher, sessions, "t1", starts_on_admit=False)
    read = first.poll(3)
    first.starting(read[1:2])  # then it dies
    second = _consumer(broker, cipher, sessions, "t1", starts_on_admit=False)
    assert [(d.entry.id, d.suspect) for d in second.poll(10)] == [
        (ids[0], False),
        (ids[2], False),
    ]
    (suspect,) = second.poll(10)  # nothing it started is unproven
    assert (suspect.entry.id, suspect.suspect) == (ids[1], True)


def test_a_suspect_that_kills_every_consumer_is_handed_over_to_be_dead_lettered(
    broker: Broker, cipher: Cipher, sessions: sessionmaker[Session]
) -> None:
    _publish(broker, 1)
    _row(sessions, "t1", state="running", age_sec=0)
    _consumer(broker, cipher, sessions, "t1", max_deliveries=2).poll(1)
    for deliveries in (1, 2):  # two more processes of this name died running it alone
        (delivery,) = _consumer(broker, cipher, sessions, "t1", max_deliveries=2).poll(1)
        assert (delivery.deliveries, delivery.suspect) == (deliveries, True)
    last = _consumer(broker, cipher, sessions, "t1", max_deliveries=2)
    (delivery,) = last.poll(1)
    assert (delivery.deliveries, delivery.suspect) == (3, False)
    assert last.exhausted(delivery)
    assert "delivered 3 times, and each of the 2 consumers" in last.exhausted_reason(delivery)


def test_replayed_evidence_of_a_name_that_stopped_cleanly_or_never_ran_is_not_believed(
    broker: Broker, cipher: Cipher, sessions: sessionmaker[Session]
) -> None:
    ids = _publish(broker, 2)
    broker.ensure_group(broker.keys.triggers, GROUP)
    broker.read(GROUP, "t1", {broker.keys.triggers: ">"}, count=2)
    broker.redis.hset(broker.keys.started(broker.keys.triggers), mapping=dict.fromkeys(ids, 10))
    restarted = _consumer(broker, cipher, sessions, "t1")  # no row: never registered
    assert [(d.deliveries, d.suspect) for d in restarted.poll(10)] == [(1, False), (1, False)]


def test_suspects_run_one_at_a_time_in_the_whole_group(
    broker: Broker, cipher: Cipher, sessions: sessionmaker[Session]
) -> None:
    """A takeover by a peer and the replay of the restarted name each find suspects: only one
    runs at a time, and the peer does not read new entries while it waits to take one."""
    ids = _publish(broker, 4)
    for name in ("t1", "t2", "t3"):
        _row(sessions, name, state="running", age_sec=0)
    dead = _consumer(broker, cipher, sessions, "t2")
    dead.poll(2)  # t2 dies running these two: suspects
    _row(sessions, "t2", state="running", age_sec=60)
    _consumer(broker, cipher, sessions, "t1").poll(2)  # t1 too, with the other two
    time.sleep(HB * 2.5)  # t2's entries idle past the takeover threshold
    restarted = _consumer(broker, cipher, sessions, "t1")
    (replayed,) = restarted.poll(10)
    assert (replayed.entry.id, replayed.suspect) == (ids[2], True)
    assert restarted.renew() == []  # its own suspect waiting for its turn stays with it
    peer = _consumer(broker, cipher, sessions, "t3")
    assert peer.claim(10) == []  # t1 runs a suspect: the peer waits
    newer = _publish(broker, 1)
    # Nothing unproven there and the claim is t1's: it reads on (and drains before its turn).
    assert [d.entry.id for d in peer.poll(10)] == newer
    assert restarted.poll(10, block_ms=10) == []  # the restarted one starts nothing beside it
    _survive_a_heartbeat(restarted)
    (taken,) = wait_for(lambda: peer.claim(10), timeout=10, what="the next suspect")
    assert (taken.entry.id, taken.suspect, taken.taken_from) == (ids[0], True, "t2")
    assert broker.suspect_holder(broker.keys.triggers) == "t3"
    assert restarted.poll(10, block_ms=10) == []  # its own last suspect waits its turn


def test_a_suspect_taken_by_a_peer_while_it_is_chosen_is_not_replayed(
    broker: Broker,
    cipher: Cipher,
    sessions: sessionmaker[Session],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The triggerer renews from a thread of its own, and peers take over meanwhile: a suspect
    a peer took while the replay chose it stays with the peer."""
    (entry_id,) = _publish(broker, 1)
    _row(sessions, "t1", state="running", age_sec=0)
    _consumer(broker, cipher, sessions, "t1").poll(1)  # then it dies within the heartbeat
    restarted = _consumer(broker, cipher, sessions, "t1")
    take = broker.take_suspect

    def taken_first(*args: Any, **kwargs: Any) -> Any:
        broker.redis.execute_command(
            "XCLAIM", broker.keys.triggers, GROUP, "peer", 0, entry_id, "JUSTID"
        )
        return take(*args, **kwargs)

    monkeypatch.setattr(broker, "take_suspect", taken_first)
    assert restarted.poll(10) == []
    assert broker.owners_of(broker.keys.triggers, GROUP, [entry_id])[entry_id].consumer == "peer"


# -- consumers of stopped processes -----------------------------------------------------------


def test_two_hundred_restarts_with_fresh_names_leave_only_live_or_busy_consumers(
    broker: Broker, cipher: Cipher, sessions: sessionmaker[Session]
) -> None:
    """Driven in process: a real service start per restart would take minutes on this loaded
    machine; what is tested is the core's pruning, which every service runs from its renewals."""
    _publish(broker, 3)
    busy = _consumer(broker, cipher, sessions, "busy-dead")
    assert len(busy.poll(3)) == 3  # it dies holding these: its consumer must stay
    _row(sessions, "busy-dead", state="running", age_sec=60)
    for n in range(200):
        name = f"t-{n}"
        _row(sessions, name, state="running", age_sec=0)
        consumer = _consumer(broker, cipher, sessions, name)
        _publish(broker, 1)
        consumer.retire([d.entry for d in consumer.poll(1)])
        if n % 2:
            _row(sessions, name, state="stopped", age_sec=0)  # a clean stop
        else:
            _row(sessions, name, state="running", age_sec=60)  # killed: its heartbeat went stale
    _row(sessions, "live", state="running", age_sec=0)
    live = _consumer(broker, cipher, sessions, "live")
    broker.redis.execute_command("XGROUP", "CREATECONSUMER", broker.keys.triggers, GROUP, "live")
    broker.redis.execute_command("XGROUP", "CREATECONSUMER", broker.keys.triggers, GROUP, "x")
    assert len(broker.consumers(broker.keys.triggers, GROUP)) == 203
    assert len(live.prune_consumers()) == 201
    assert broker.consumers(broker.keys.triggers, GROUP) == {"busy-dead": 3, "live": 0}


def test_a_replay_never_takes_back_an_entry_a_peer_took_over_meanwhile(
    broker: Broker,
    cipher: Cipher,
    sessions: sessionmaker[Session],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    ids = _publish(broker, 2)
    _row(sessions, "t1", state="running", age_sec=0)
    first = _consumer(broker, cipher, sessions, "t1")
    first.poll(2)
    _survive_a_heartbeat(first)
    time.sleep(0.05)  # then it dies; its entries idle
    listed = broker.own_pending

    def listed_then_taken(*args: object, **kwargs: object) -> object:
        page = listed(*args, **kwargs)  # type: ignore[arg-type]
        broker.redis.execute_command(
            "XCLAIM", broker.keys.triggers, GROUP, "peer", 0, ids[0], "JUSTID"
        )
        return page

    monkeypatch.setattr(broker, "own_pending", listed_then_taken)
    restarted = _consumer(broker, cipher, sessions, "t1")
    assert [d.entry.id for d in restarted.poll(10)] == [ids[1]]
    assert broker.owners_of(broker.keys.triggers, GROUP, [ids[0]])[ids[0]].consumer == "peer"
    assert int(broker.redis.xlen(broker.keys.triggers)) == 2  # nothing retired


def test_suspects_waiting_for_their_turn_stay_with_the_replaying_consumer(
    broker: Broker, cipher: Cipher, sessions: sessionmaker[Session]
) -> None:
    """Its row looks alive (it restarted), so a peer would take them with their evidence
    ignored and run them together: the replaying consumer keeps renewing them instead."""
    ids = _publish(broker, 3)
    _row(sessions, "t1", state="running", age_sec=0)
    _row(sessions, "t2", state="running", age_sec=0)
    _consumer(broker, cipher, sessions, "t1").poll(3)  # then it dies within the heartbeat
    restarted = _consumer(broker, cipher, sessions, "t1")
    (first,) = restarted.poll(10)
    assert first.entry.id == ids[0]
    peer = _consumer(broker, cipher, sessions, "t2")
    for _ in range(4):  # past the takeover threshold, renewing as the service does
        time.sleep(HB)
        assert restarted.renew() == []
        assert peer.claim(10) == []
    (second,) = restarted.poll(10)
    assert (second.entry.id, second.deliveries, second.suspect) == (ids[1], 1, True)
    assert {p.consumer for p in broker.all_own_pending(broker.keys.triggers, GROUP, "t1")} == {"t1"}


def test_a_restarted_consumers_own_takeover_leaves_its_entries_to_the_replay(
    broker: Broker, cipher: Cipher, sessions: sessionmaker[Session]
) -> None:
    """The restarted process looks for takeovers too (a worker's first step does so before its
    first read), when its entries have idled past the threshold: they are replayed, suspects one
    at a time, not taken over together with their evidence ignored (its new row looks alive)."""
    ids = _publish(broker, 3)
    _row(sessions, "t1", state="running", age_sec=0)
    _consumer(broker, cipher, sessions, "t1").poll(3)  # then it dies within the heartbeat
    time.sleep(HB * 3)  # restarted after the takeover threshold
    restarted = _consumer(broker, cipher, sessions, "t1")
    _row(sessions, "t1", state="running", age_sec=0)  # the restarted process registered
    assert restarted.claim(10) == []
    (first,) = restarted.poll(10)
    assert (first.entry.id, first.deliveries, first.suspect) == (ids[0], 1, True)
    assert restarted.claim(10) == []  # the suspects waiting for their turn stay queued
    assert restarted.poll(10, block_ms=10) == []
    assert [restarted.holds(i) for i in ids] == [True, False, False]


def test_an_entry_taken_over_is_reported_lost_while_its_holders_row_cannot_be_read(
    broker: Broker,
    cipher: Cipher,
    sessions: sessionmaker[Session],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The take-back of forged claims asks PostgreSQL who the holder is; while it cannot, the
    renewal still says the entry is lost (it raised, so the triggerer kept running a trigger a
    peer had taken over, for as long as PostgreSQL was unavailable)."""
    (entry_id,) = _publish(broker, 1)
    _row(sessions, "t1", state="running", age_sec=0)
    consumer = _consumer(broker, cipher, sessions, "t1")
    consumer.poll(1)
    _set_holder(broker, entry_id, "t2", 1, 0)  # a peer took it over

    def unavailable(names: object) -> dict[str, object]:
        raise OperationalError("SELECT", {}, Exception("server closed the connection"))

    assert consumer.owners is not None
    monkeypatch.setattr(consumer.owners, "owners", unavailable)
    assert [(lost.entry_id, lost.status) for lost in consumer.renew()] == [
        (entry_id, LeaseStatus.TAKEN)
    ]
    assert not consumer.holds(entry_id)


def test_a_renewal_in_chunks_finds_what_is_lost_in_any_chunk_and_renews_the_rest(
    broker: Broker,
    cipher: Cipher,
    sessions: sessionmaker[Session],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Held ids are renewed a chunk at a time (broker rule 41), only what is no longer ours
    kept: an entry gone in the last chunk is lost, the others are renewed (idle reset)."""
    monkeypatch.setattr("broker.consumer.RENEW_CHUNK", 2)
    _row(sessions, "t1", state="running", age_sec=0)
    consumer = _consumer(broker, cipher, sessions, "t1", starts_on_admit=False)
    ids = _publish(broker, 5)
    assert [d.entry.id for d in consumer.poll(5)] == ids
    broker.retire(GROUP, [Entry(broker.keys.triggers, ids[4], {})])  # by a peer, say
    time.sleep(0.05)  # idle to reset: the renewal must not leave the held ones idle
    lost = consumer.renew()
    assert [(item.entry_id, item.status) for item in lost] == [(ids[4], LeaseStatus.GONE)]
    assert consumer.held == 4 and all(consumer.holds(i) for i in ids[:4])
    renewed = broker.own_pending(broker.keys.triggers, GROUP, "t1")
    assert sorted(p.id for p in renewed if p.idle_ms < 50) == ids[:4]
