"""A recorded outcome wakes a scheduler (issue 13, task-to-task latency and throughput): the
worker that records a success, failure or skip (the run is marked), or a deferral, reschedule or
wait for input (a pool slot is free), adds a wake entry to the events stream after its commit,
and a scheduler that reads one retires it, then evaluates the marked runs and queues what the
free slots allow in the loop that follows, instead of after its blocking read for events times
out."""

from __future__ import annotations

import datetime as dt
import time

import pytest
import redis
from sqlalchemy.orm import Session, sessionmaker

from broker.client import Broker
from broker.consumer import Delivery
from broker.replies import Entry
from broker.streams import GROUP_SCHEDULERS, WAKE, is_wake
from deferral.runtime.config import Settings
from deferral.store import transitions
from deferral.store.transitions import Attempt
from scheduler.service import SchedulerService
from tests.integration.factories import WORKER, running_task
from tests.servers import REDIS_URL
from worker.outcomes import Rescheduled, Succeeded
from worker.service import Running, WorkerService


def _running(worker: WorkerService, ti_id: int, entry_id: str) -> Running:
    delivery = Delivery(Entry(worker.streams[0], entry_id, {}), 1)
    return Running(delivery, Attempt(ti_id, 1, WORKER), "d.t")


def test_a_recorded_success_wakes_a_scheduler_and_a_dropped_one_does_not(
    worker: WorkerService, sessions: sessionmaker[Session]
) -> None:
    events = worker.keys.events
    stale = running_task(sessions, run_id="r0")
    with sessions.begin() as session:  # its attempt is no longer this worker's to end
        transitions.fail(session, Attempt(stale, 1, WORKER), "lease lost", allow_retry=False)
    worker.recorder.record([(_running(worker, stale, "0-1"), Succeeded(None))])
    assert worker.broker.xrange(events) == []

    ti_id = running_task(sessions, run_id="r1")
    worker.recorder.record([(_running(worker, ti_id, "0-2"), Succeeded(None))])
    (entry,) = worker.broker.xrange(events)
    assert is_wake(entry.fields)


def test_a_recorded_reschedule_frees_a_slot_and_wakes_a_scheduler(
    worker: WorkerService, sessions: sessionmaker[Session]
) -> None:
    ti_id = running_task(sessions, run_id="r2")
    later = dt.datetime.now(dt.UTC) + dt.timedelta(minutes=1)
    worker.recorder.record([(_running(worker, ti_id, "0-3"), Rescheduled(later))])
    (entry,) = worker.broker.xrange(worker.keys.events)
    assert is_wake(entry.fields)


def test_a_scheduler_retires_a_wake_without_waiting_for_events(settings: Settings) -> None:
    scheduler = SchedulerService(settings, name="awake")
    scheduler.attach(Broker.from_url(REDIS_URL, settings.stream_prefix))
    scheduler.consumer.start()
    scheduler.broker.publish(scheduler.keys.events, WAKE)

    started = time.monotonic()
    assert scheduler.events.apply(block_ms=30_000) == 0
    # Returned on the wake, not after the 30 s wait: the next loop evaluates marked runs.
    assert time.monotonic() - started < 25
    assert scheduler.broker.pending(scheduler.keys.events, GROUP_SCHEDULERS).count == 0
    assert scheduler.broker.xrange(scheduler.keys.events) == []  # retired, not kept
    assert scheduler.broker.xrange(scheduler.keys.dead) == []  # and not a bad event
    assert scheduler.events.unapplied == []
    scheduler.broker.close()


def test_events_read_with_a_wake_whose_retirement_fails_are_applied_next(
    settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Redis failing between the read and the wake's retirement must not leave the events read
    with it held and renewed by this scheduler for ever, never applied."""
    scheduler = SchedulerService(settings, name="awake")
    scheduler.attach(Broker.from_url(REDIS_URL, settings.stream_prefix))
    scheduler.consumer.start()
    events = scheduler.keys.events
    scheduler.broker.publish(events, WAKE)
    event_id = scheduler.broker.publish(events, {"trigger_id": "1", "junk": "x"})
    retire = scheduler.consumer.retire

    def failing(entries: object) -> None:
        raise redis.ConnectionError("Redis went away")

    monkeypatch.setattr(scheduler.consumer, "retire", failing)
    with pytest.raises(redis.ConnectionError):
        scheduler.events.apply(block_ms=10)
    monkeypatch.setattr(scheduler.consumer, "retire", retire)
    scheduler.events.apply(block_ms=10)
    # The event was handled (a bad one: dead-lettered), not kept held by this scheduler.
    assert not scheduler.consumer.holds(Entry(events, event_id, {}))
    assert [
        e.fields[b"source_id"].decode() for e in scheduler.broker.xrange(scheduler.keys.dead)
    ] == [event_id]
    scheduler.broker.close()
