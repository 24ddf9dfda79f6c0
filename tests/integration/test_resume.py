"""deferred -> scheduled: dedup-keyed, conditional, applied at most once per event."""

from __future__ import annotations

import datetime as dt
import threading
from typing import Any

import pytest
from sqlalchemy import select, text
from sqlalchemy.orm import Session, sessionmaker

from broker import streams
from broker.client import Broker
from broker.streams import GROUP_SCHEDULERS, DeadLetterMessage, from_fields, open_dead_letter
from deferral.runtime.config import Settings
from deferral.runtime.crypto import Cipher, Purpose
from deferral.states import FAIL_METHOD, TaskState
from deferral.store import tasklogs, transitions
from deferral.store.tables import ResumeEvent, TaskInstance, TaskStateChange, Trigger
from deferral.store.transitions import deferrals
from scheduler.dispatch import DEFAULT_MAX_ACTIVE_TASKS
from scheduler.service import SchedulerService
from tests.integration.factories import deferred_task, running_task
from tests.servers import REDIS_URL
from triggerer.events import event_message, failure_message


def _transitions(sessions: sessionmaker[Session], ti_id: int) -> list[tuple[str, str]]:
    with sessions() as session:
        rows = session.execute(
            select(TaskStateChange.from_state, TaskStateChange.to_state)
            .where(TaskStateChange.task_instance_id == ti_id)
            .order_by(TaskStateChange.id)
        )
        return [(r.from_state, r.to_state) for r in rows]


def _ti(sessions: sessionmaker[Session], ti_id: int) -> TaskInstance:
    with sessions() as session:
        ti = session.get(TaskInstance, ti_id)
        assert ti is not None
        return ti


def _scheduler(settings: Settings, broker: Broker, name: str = "s1") -> SchedulerService:
    service = SchedulerService(settings, name=name)
    service.attach(Broker.from_url(REDIS_URL, settings.stream_prefix))
    service.consumer.start()
    return service


def _drain(service: SchedulerService) -> None:
    while service.events.apply(block_ms=None):
        pass


def test_same_event_published_twice_resumes_once(
    settings: Settings, sessions: sessionmaker[Session], cipher: Cipher, broker: Broker
) -> None:
    ti_id, trigger_id = deferred_task(sessions, cipher, next_kwargs={"attempt": 7})
    service = _scheduler(settings, broker)
    message = event_message(cipher, trigger_id, {"status": "done"}, "triggerer-1")
    broker.publish(broker.keys.events, message)
    broker.publish(broker.keys.events, message)

    _drain(service)

    # Resumed and queued in the same batch.
    assert _transitions(sessions, ti_id)[-2:] == [
        ("deferred", "scheduled"),
        ("scheduled", "queued"),
    ]
    assert _transitions(sessions, ti_id).count(("deferred", "scheduled")) == 1
    ti = _ti(sessions, ti_id)
    assert ti.state == TaskState.QUEUED and ti.trigger_id is None
    assert ti.next_method == "resume"
    assert ti.next_kwargs is not None
    # The kwargs as the task deferred with them, the event beside them as the triggerer sealed it.
    assert cipher.open(Purpose.RESUME_KWARGS, ti.next_kwargs) == {"attempt": 7}
    assert ti.next_event == message.payload
    assert cipher.open(Purpose.EVENT, ti.next_event) == {"status": "done"}
    with sessions() as session:
        events = session.scalars(select(ResumeEvent)).all()
        assert session.get(Trigger, trigger_id) is None
    assert [(e.dedup_key, e.outcome, e.task_instance_id) for e in events] == [
        (message.dedup_key, "applied", ti_id)
    ]
    assert broker.pending(broker.keys.events, GROUP_SCHEDULERS).count == 0
    assert broker.redis.xlen(broker.keys.events) == 0
    assert broker.present(broker.keys.queue("default"), [str(ti_id)]) == {str(ti_id): True}


def test_two_scheduler_replicas_racing_on_duplicates_apply_once(
    settings: Settings, sessions: sessionmaker[Session], cipher: Cipher, broker: Broker
) -> None:
    ti_id, trigger_id = deferred_task(sessions, cipher)
    replicas = [_scheduler(settings, broker, f"s{i}") for i in range(2)]
    message = event_message(cipher, trigger_id, "fired", "triggerer-1")
    for _ in range(6):
        broker.publish(broker.keys.events, message)

    threads = [threading.Thread(target=_drain, args=(replica,)) for replica in replicas]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)

    assert _transitions(sessions, ti_id).count(("deferred", "scheduled")) == 1
    assert broker.redis.xlen(broker.keys.events) == 0


def test_event_for_a_task_no_longer_deferred_is_recorded_stale(
    settings: Settings, sessions: sessionmaker[Session], cipher: Cipher, broker: Broker
) -> None:
    ti_id, trigger_id = deferred_task(sessions, cipher)
    service = _scheduler(settings, broker)
    broker.publish(broker.keys.events, event_message(cipher, trigger_id, 1, "t"))
    _drain(service)
    # A later, different event for the same trigger finds the task already resumed.
    broker.publish(broker.keys.events, event_message(cipher, trigger_id, 2, "t"))
    _drain(service)

    with sessions() as session:
        outcomes = sorted(session.scalars(select(ResumeEvent.outcome)))
    assert outcomes == ["applied", "stale"]
    assert _transitions(sessions, ti_id).count(("deferred", "scheduled")) == 1
    assert cipher.open(Purpose.EVENT, _ti(sessions, ti_id).next_event or "") == 1


def test_failure_event_resumes_at_fail_with_the_reason(
    settings: Settings, sessions: sessionmaker[Session], cipher: Cipher, broker: Broker
) -> None:
    ti_id, trigger_id = deferred_task(sessions, cipher)
    service = _scheduler(settings, broker)
    broker.publish(
        broker.keys.events,
        failure_message(cipher, trigger_id, "trigger raised KeyError", "Traceback", "t"),
    )
    _drain(service)

    ti = _ti(sessions, ti_id)
    assert ti.state == TaskState.QUEUED and ti.next_method == FAIL_METHOD
    kwargs = cipher.open(Purpose.RESUME_KWARGS, ti.next_kwargs or "")
    assert kwargs["error"] == "trigger_failure"
    assert kwargs["message"] == "trigger raised KeyError"


def test_unreadable_payload_fails_the_task_and_malformed_entry_is_dead_lettered(
    settings: Settings, sessions: sessionmaker[Session], cipher: Cipher, broker: Broker
) -> None:
    ti_id, trigger_id = deferred_task(sessions, cipher)
    other_ti, other_trigger = deferred_task(sessions, cipher, task_id="u", run_id="r2")
    service = _scheduler(settings, broker)
    unreadable = streams.event_message(cipher, trigger_id, f"{trigger_id}:k", "event", "{no", "t")
    broker.publish(broker.keys.events, unreadable)
    broker.publish(broker.keys.events, {"trigger_id": "oops"})
    broker.publish(broker.keys.events, event_message(cipher, other_trigger, "fine", "t"))
    _drain(service)

    ti = _ti(sessions, ti_id)
    assert ti.next_method == FAIL_METHOD
    assert "unreadable event" in cipher.open(Purpose.RESUME_KWARGS, ti.next_kwargs or "")["message"]
    # The good event after the bad ones was applied all the same.
    assert _ti(sessions, other_ti).next_method == "resume"
    dead = broker.xrange(broker.keys.dead)
    assert len(dead) == 1
    assert b"bad event entry: malformed EventMessage" in dead[0].fields[b"error"]
    assert broker.redis.xlen(broker.keys.events) == 0


def test_expired_deferrals_are_failed_in_bulk_and_their_triggers_dropped(
    sessions: sessionmaker[Session], cipher: Cipher
) -> None:
    past = dt.datetime.now(dt.UTC) - dt.timedelta(seconds=1)
    future = dt.datetime.now(dt.UTC) + dt.timedelta(hours=1)
    expired_ti, expired_trigger = deferred_task(sessions, cipher, trigger_timeout=past)
    waiting_ti, _ = deferred_task(
        sessions, cipher, trigger_timeout=future, task_id="w", run_id="r2"
    )

    with sessions.begin() as session:
        assert transitions.expire_deferrals(session, cipher) == [expired_ti]

    ti = _ti(sessions, expired_ti)
    assert ti.state == TaskState.SCHEDULED and ti.next_method == FAIL_METHOD
    assert cipher.open(Purpose.RESUME_KWARGS, ti.next_kwargs or "") == {"error": "timeout"}
    assert _transitions(sessions, expired_ti)[-1] == ("deferred", "scheduled")
    assert _ti(sessions, waiting_ti).state == TaskState.DEFERRED
    with sessions() as session:
        assert session.get(Trigger, expired_trigger) is None


def test_a_queue_message_starts_an_attempt_at_most_once(sessions: sessionmaker[Session]) -> None:
    ti_id = running_task(sessions)  # started once at try 1 already
    with sessions.begin() as session:
        assert transitions.start_many(session, [(ti_id, 1), (ti_id, 2)], "host", "worker-2") == []
    assert _transitions(sessions, ti_id).count(("queued", "running")) == 1


def test_a_batch_applies_together_and_a_poisoned_row_goes_alone_to_the_dead_letters(
    settings: Settings,
    sessions: sessionmaker[Session],
    cipher: Cipher,
    broker: Broker,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    good = [deferred_task(sessions, cipher, task_id=f"g{i}", run_id=f"r{i}") for i in range(5)]
    bad_ti, bad_trigger = deferred_task(sessions, cipher, task_id="bad", run_id="rbad")
    sealed_event = deferrals._sealed_event

    def poisoned(event: transitions.FiredEvent, *args: Any) -> Any:
        if event.trigger_id == bad_trigger:  # a row whose data cannot be applied
            raise ValueError(f"row of trigger {bad_trigger} cannot be applied")
        return sealed_event(event, *args)

    monkeypatch.setattr(deferrals, "_sealed_event", poisoned)
    service = _scheduler(settings, broker)
    for _, trigger_id in good[:3]:
        broker.publish(broker.keys.events, event_message(cipher, trigger_id, "ok", "t"))
    broker.publish(broker.keys.events, event_message(cipher, bad_trigger, "ok", "t"))
    for _, trigger_id in good[3:]:
        broker.publish(broker.keys.events, event_message(cipher, trigger_id, "ok", "t"))

    _drain(service)

    assert [_ti(sessions, ti_id).state for ti_id, _ in good] == ["queued"] * 5
    assert _ti(sessions, bad_ti).state == "deferred"
    dead = broker.xrange(broker.keys.dead)
    assert len(dead) == 1
    original = open_dead_letter(cipher, from_fields(DeadLetterMessage, dead[0].fields))
    assert original.fields["trigger_id"] == str(bad_trigger)
    assert b"cannot apply event" in dead[0].fields[b"error"]
    assert broker.redis.xlen(broker.keys.events) == 0


def test_the_lines_an_event_carries_are_stored_with_it_once(
    settings: Settings, sessions: sessionmaker[Session], cipher: Cipher, broker: Broker
) -> None:
    ti_id, trigger_id = deferred_task(sessions, cipher)
    at = dt.datetime(2026, 1, 1, tzinfo=dt.UTC).timestamp()
    carried = streams.CarriedLog(ti_id, 1, [(at, "trigger says hello"), (at, "fired: 1")])
    message = streams.with_log(cipher, event_message(cipher, trigger_id, 1, "t1"), carried)
    broker.publish(broker.keys.events, message)
    broker.publish(broker.keys.events, message)  # a duplicate stores nothing more

    _drain(_scheduler(settings, broker))

    assert _ti(sessions, ti_id).state == TaskState.QUEUED
    with sessions() as session:
        lines = tasklogs.read_lines(session, ti_id, 1)
    assert [(line.source, line.text, line.at.timestamp()) for line in lines] == [
        ("triggerer", "trigger says hello", at),
        ("triggerer", "fired: 1", at),
    ]


def test_resumed_tasks_are_queued_within_their_runs_max_active_tasks(
    settings: Settings, sessions: sessionmaker[Session], cipher: Cipher, broker: Broker
) -> None:
    busy_ti, busy_trigger = deferred_task(sessions, cipher, run_id="busy")
    free_ti, free_trigger = deferred_task(sessions, cipher, run_id="free")
    with sessions.begin() as session:  # the busy run has as many running as a DAG may by default
        session.execute(
            text(
                "INSERT INTO task_instance (dag_id, run_id, task_id, state, try_number)"
                " SELECT dag_id, run_id, 'other' || n, 'running', 1"
                " FROM task_instance, generate_series(1, :n) AS n WHERE id = :ti"
            ),
            {"n": DEFAULT_MAX_ACTIVE_TASKS, "ti": busy_ti},
        )
    for trigger_id in (busy_trigger, free_trigger):
        broker.publish(broker.keys.events, event_message(cipher, trigger_id, 1, "t1"))

    _drain(_scheduler(settings, broker))

    assert _ti(sessions, busy_ti).state == TaskState.SCHEDULED
    assert _ti(sessions, free_ti).state == TaskState.QUEUED


def test_two_events_of_one_trigger_in_one_batch_the_first_applies_and_each_key_is_written_once(
    sessions: sessionmaker[Session], cipher: Cipher
) -> None:
    ti_id, trigger_id = deferred_task(sessions, cipher)
    events = [
        transitions.FiredEvent(f"key-{n}", trigger_id, failed=False, payload=n) for n in (1, 2)
    ]
    with sessions.begin() as session:
        outcomes = transitions.resume_many(session, events, cipher)
        # Each key's outcome is decided before its row is inserted: no second write.
        rewritten = session.scalar(
            text("SELECT n_tup_upd FROM pg_stat_xact_user_tables WHERE relname = 'resume_event'")
        )
    assert outcomes == [transitions.Resumed("applied", ti_id), transitions.Resumed("stale")]
    assert rewritten == 0
    with sessions() as session:
        rows = session.execute(
            select(
                ResumeEvent.dedup_key, ResumeEvent.outcome, ResumeEvent.task_instance_id
            ).order_by(ResumeEvent.dedup_key)
        ).all()
    assert [tuple(r) for r in rows] == [("key-1", "applied", ti_id), ("key-2", "stale", None)]
    assert cipher.open(Purpose.EVENT, _ti(sessions, ti_id).next_event or "") == 1
