"""A triggerer's look for a dead peer's entries takes all of them it has room for, not one read
batch per look (which made failover.py's kill -9 take twice as long to recover: see
benchmarks/README.md, "Figures behind code choices")."""

from __future__ import annotations

import datetime as dt
import logging

import anyio
import pytest
import redis
from sqlalchemy.orm import Session, sessionmaker

from broker.client import Broker, LeaseStatus
from broker.consumer import Lost
from broker.replies import Entry
from broker.streams import GROUP_TRIGGERERS, TriggerMessage, to_fields
from deferral.runtime.config import Settings
from deferral.runtime.crypto import Cipher
from deferral.store.tables import Triggerer
from tests.integration.factories import deferred_timers
from triggerer.service import READ_BATCH, Held, TriggererService

DEAD_HELD = 2 * READ_BATCH + 50


def _timer_messages(
    sessions: sessionmaker[Session], cipher: Cipher, count: int
) -> list[TriggerMessage]:
    """The entries of ``count`` deferred tasks' triggers that fire in a day."""
    moment = dt.datetime.now(dt.UTC) + dt.timedelta(days=1)
    return deferred_timers(sessions, cipher, count, moment)


def _dead_peer_held(
    broker: Broker, sessions: sessionmaker[Session], cipher: Cipher, count: int
) -> None:
    """``count`` trigger entries read by a consumer that then died (long idle)."""
    stream = broker.keys.triggers
    broker.ensure_group(stream, GROUP_TRIGGERERS)
    broker.publish_many([(stream, to_fields(m)) for m in _timer_messages(sessions, cipher, count)])
    entries = broker.read(GROUP_TRIGGERERS, "dead", {stream: ">"}, count=count)
    ids = [e.id for e in entries]
    # Held a while (renewed as survivors: none of them killed it), then it died.
    broker.renew(stream, GROUP_TRIGGERERS, "dead", ids, survivors=ids)
    broker.hand_off(stream, GROUP_TRIGGERERS, "dead", ids, idle_ms=600_000)


def _reading_service(settings: Settings, broker: Broker) -> TriggererService:
    broker.ensure_group(broker.keys.triggers, GROUP_TRIGGERERS)
    service = TriggererService(settings, capacity=10, name="t1")
    service.attach(broker)
    service.consumer.start()
    return service


def _register_dead_peer(sessions: sessionmaker[Session]) -> None:
    """The row of the triggerer "dead": running, its last heartbeat before its entries went idle."""
    with sessions.begin() as session:
        session.add(
            Triggerer(
                name="dead",
                hostname="h",
                pid=1,
                capacity=1000,
                state="running",
                latest_heartbeat=dt.datetime.now(dt.UTC) - dt.timedelta(seconds=700),
            )
        )


def _one_look(service: TriggererService) -> None:
    async def look() -> None:
        async with anyio.create_task_group() as tasks:
            await service.take_over(tasks)
            tasks.cancel_scope.cancel()

    anyio.run(look)


def test_one_look_takes_every_entry_of_a_dead_triggerer(
    settings: Settings, broker: Broker, cipher: Cipher, sessions: sessionmaker[Session]
) -> None:
    _dead_peer_held(broker, sessions, cipher, DEAD_HELD)
    _register_dead_peer(sessions)
    service = TriggererService(settings, capacity=DEAD_HELD, name="alive")
    service.attach(broker)

    _one_look(service)

    assert len(service.held) == DEAD_HELD
    assert broker.pending(broker.keys.triggers, GROUP_TRIGGERERS).per_consumer == {
        "alive": DEAD_HELD
    }


def test_timers_taken_over_are_named_in_their_tries_logs_and_once_a_batch_here(
    settings: Settings,
    broker: Broker,
    cipher: Cipher,
    sessions: sessionmaker[Session],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A line each on the triggerer's own log was half of what moving a hundred thousand timers
    cost: each try's log still says where its trigger went."""
    _dead_peer_held(broker, sessions, cipher, DEAD_HELD)
    _register_dead_peer(sessions)
    service = TriggererService(settings, capacity=DEAD_HELD, name="alive")
    service.attach(broker)

    with caplog.at_level(logging.INFO, logger="deferral.triggerer"):
        _one_look(service)

    tried = service.task_logs.handler.take()
    assert len(tried) == DEAD_HELD
    assert all(line.text.endswith("started on triggerer alive") for line in tried)
    assert {line.task_instance_id for line in tried} == {
        h.task_instance_id for h in service.held.values()
    }
    said = [r.getMessage() for r in caplog.records if "started on triggerer" in r.getMessage()]
    assert len(said) == -(-DEAD_HELD // READ_BATCH)  # one a batch
    assert sum(int(line.split()[0]) for line in said) == DEAD_HELD
    assert all("held by dead" in line for line in said)


def test_one_look_takes_no_more_than_the_capacity_left(
    settings: Settings, broker: Broker, cipher: Cipher, sessions: sessionmaker[Session]
) -> None:
    _dead_peer_held(broker, sessions, cipher, DEAD_HELD)
    _register_dead_peer(sessions)
    service = TriggererService(settings, capacity=READ_BATCH + 10, name="alive")
    service.attach(broker)

    _one_look(service)

    assert len(service.held) == READ_BATCH + 10
    pending = broker.pending(broker.keys.triggers, GROUP_TRIGGERERS).per_consumer
    assert pending == {"alive": READ_BATCH + 10, "dead": DEAD_HELD - READ_BATCH - 10}


def test_a_republished_entry_read_while_the_lost_one_is_checked_keeps_the_trigger(
    settings: Settings, broker: Broker, cipher: Cipher
) -> None:
    """The entry a trigger held vanished (Redis lost it) and the reconciler republished it; this
    triggerer reads the republished entry while it asks whether one exists elsewhere. The trigger
    now holds the new entry: cancelling it as reassigned would leave that entry held, renewed
    and never run (the key-wipe e2e test's stuck task)."""
    service = TriggererService(settings, capacity=10, name="t1")
    service.attach(broker)
    old = Entry(broker.keys.triggers, "1-1", {b"trigger_id": b"7"})
    new = Entry(broker.keys.triggers, "2-1", {b"trigger_id": b"7"})
    moment = dt.datetime.now(dt.UTC) + dt.timedelta(days=1)
    held = Held(7, old, None, "d.r.t", 7, 1, moment=moment)
    service.held[7] = held

    def present_after_the_swap(stream: str, index_fields: list[str]) -> dict[str, bool]:
        held.entry = new  # what _start does with a newer entry for a trigger running here
        return {"7": True}

    service.broker.present = present_after_the_swap  # type: ignore[method-assign]
    anyio.run(service._lost, [Lost(old.stream, old.id, LeaseStatus.GONE)])
    assert service.held[7] is held and not held.cancelled

    # Still the lost entry: a peer holds the newer one, so the trigger stops here.
    held.entry = old
    service.broker.present = lambda stream, index_fields: {"7": True}  # type: ignore[method-assign]
    anyio.run(service._lost, [Lost(old.stream, old.id, LeaseStatus.GONE)])
    assert held.cancelled and held.cancel_reason == "reassigned" and 7 not in service.held


def test_a_republished_entry_stays_held_when_retiring_the_older_one_fails(
    settings: Settings,
    broker: Broker,
    cipher: Cipher,
    sessions: sessionmaker[Session],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The trigger runs on with the newer entry: it must stay renewed here (released, a peer
    would take it over and run the trigger too), and the older entry is retired once Redis
    answers again."""
    stream = broker.keys.triggers
    service = _reading_service(settings, broker)
    [message] = _timer_messages(sessions, cipher, 1)
    trigger_id = int(message.trigger_id)
    older = broker.publish(stream, message)
    newer = broker.publish(stream, message)  # the reconciler's republish
    retire = service.consumer.retire

    def failing(entries: object) -> None:
        raise redis.ConnectionError("Redis went away")

    async def read_both() -> None:
        async with anyio.create_task_group() as tasks:
            for _ in range(2):
                await service.starter.start_all(tasks, service.consumer.poll(1))
            tasks.cancel_scope.cancel()

    monkeypatch.setattr(service.consumer, "retire", failing)
    anyio.run(read_both)
    assert service.held[trigger_id].entry.id == newer
    assert service.consumer.holds(Entry(stream, newer, {}))
    monkeypatch.setattr(service.consumer, "retire", retire)
    anyio.run(service.publisher.flush)
    assert not service.consumer.holds(Entry(stream, older, {}))
    assert [e.id for e in broker.xrange(stream)] == [newer]


def test_a_republished_entry_read_while_its_cancelled_trigger_unwinds_is_run(
    settings: Settings, broker: Broker, cipher: Cipher, sessions: sessionmaker[Session]
) -> None:
    """The trigger was cancelled (reassigned: its old entry vanished and a newer one exists) but
    its task has not ended yet when this triggerer reads the newer entry. The newer entry starts
    the trigger anew: swapped into the ending one, it would stay held and renewed here, and
    never run."""
    stream = broker.keys.triggers
    service = _reading_service(settings, broker)
    [message] = _timer_messages(sessions, cipher, 1)
    newer = broker.publish(stream, message)
    ending: list[Held] = []
    tid = int(message.trigger_id)

    async def read() -> None:
        held = Held(tid, Entry(stream, "1-1", {}), anyio.CancelScope(), message.task, 1, 1)
        held.cancelled, held.cancel_reason = True, "reassigned"
        service.held[tid] = held
        ending.append(held)
        async with anyio.create_task_group() as tasks:
            await service.starter.start_all(tasks, service.consumer.poll(1))
            tasks.cancel_scope.cancel()

    anyio.run(read)
    started = service.held[tid]
    assert started is not ending[0] and started.entry.id == newer and not started.cancelled
    service._release(tid, ending[0])  # the ending task's last step leaves the new one alone
    assert service.held[tid] is started


def test_an_entry_lost_in_one_shard_stream_stops_no_trigger_of_another_with_the_same_id(
    settings: Settings, broker: Broker
) -> None:
    """Shard streams filled in one millisecond (a reconciler's republish) repeat entry ids. A
    lost entry of one stream named by its id alone cancelled the trigger holding the same id in
    another stream as reassigned: its entry stayed held here, renewed and never run (the Redis
    Cluster key-wipe test's stuck tasks)."""
    service = TriggererService(settings, capacity=10, name="t1")
    service.attach(broker)
    moment = dt.datetime.now(dt.UTC) + dt.timedelta(days=1)
    here = Held(7, Entry("s:{shard:00}:triggers", "5-0", {}), None, "d.r.t", 7, 1, moment=moment)
    there = Held(8, Entry("s:{shard:01}:triggers", "5-0", {}), None, "d.r.u", 8, 1, moment=moment)
    service.held.update({7: here, 8: there})
    service.broker.present = lambda stream, index_fields: dict.fromkeys(index_fields, True)  # type: ignore[method-assign]
    anyio.run(service._lost, [Lost(here.entry.stream, "5-0", LeaseStatus.GONE)])
    assert here.cancelled and here.cancel_reason == "reassigned"
    assert not there.cancelled and service.held[8] is there


def test_far_timers_doze_and_only_the_one_whose_entry_was_taken_wakes_to_stop(
    settings: Settings, broker: Broker, cipher: Cipher, sessions: sessionmaker[Session]
) -> None:
    """Far timers doze in columns (triggerer rule 35), not as a ``Held`` each. The "still
    wanted?" check wakes none of them; one whose entry a peer took over wakes and is cancelled
    (reassigned), and the others doze on, still held and renewed."""
    stream = broker.keys.triggers
    service = _reading_service(settings, broker)
    messages = _timer_messages(sessions, cipher, 3)
    ids = [broker.publish(stream, message) for message in messages]
    trigger_ids = [int(message.trigger_id) for message in messages]

    async def read() -> None:
        async with anyio.create_task_group() as tasks:
            await service.starter.start_all(tasks, service.consumer.poll(3))
            tasks.cancel_scope.cancel()

    anyio.run(read)
    assert sorted(service.held) == sorted(trigger_ids) and not service.held.live
    anyio.run(service._drop_unwanted)
    assert not service.held.live and len(service.held.far) == 3
    anyio.run(service._lost, [Lost(stream, ids[0], LeaseStatus.TAKEN)])
    assert trigger_ids[0] not in service.held and not service.held.live
    assert sorted(service.held) == sorted(trigger_ids[1:]) and len(service.held.far) == 2
    assert service.consumer.renew() == []  # the dozing ones' entries are renewed here
