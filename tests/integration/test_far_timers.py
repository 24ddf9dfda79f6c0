"""Far timers wait as rows (issue 30): a task deferring on a time trigger beyond the horizon
commits its trigger with no stream entry; no triggerer holds it, a Redis wipe and the reconciler
leave it unpublished; the horizon pass publishes it once when it comes near (once across
replicas, again after a crash between publish and commit), and its event resumes the task once.
Shared far timers and deferral timeouts keep working."""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence

import pytest
from redis.exceptions import ResponseError
from sqlalchemy import func, select, text
from sqlalchemy.orm import Session, sessionmaker

from broker import outbox
from broker.client import Broker
from broker.replies import parse_xrange
from broker.streams import GROUP_TRIGGERERS
from deferral.runtime.config import Settings
from deferral.runtime.crypto import Cipher
from deferral.runtime.serialization import check_kwargs
from deferral.states import FAIL_METHOD, TaskState
from deferral.store import far_timers, transitions
from deferral.store.tables import TaskInstance, TaskStateChange, Trigger
from deferral.triggers import DateTimeTrigger, FileTrigger, TimeDeltaTrigger
from deferral.triggers.base import classpath_of
from readmodel.doctor import _not_in_flight
from readmodel.explain import _explain_deferred
from scheduler import far_timers as horizon_pass
from scheduler.reconcile import Reconciler
from tests.conftest import delete_stream_keys
from tests.integration.factories import running_task, worker_batch
from triggerer.events import event_message
from worker.outcomes import Deferred
from worker.service import WorkerService

HORIZON = dt.timedelta(minutes=10)


@pytest.fixture
def service_env(service_env: dict[str, str]) -> dict[str, str]:
    """The product's default horizon (the tests' own is days)."""
    return {**service_env, "DEFERRAL_FAR_TIMER_HORIZON_SEC": str(HORIZON.total_seconds())}


def _time_trigger(
    ahead: dt.timedelta,
    cls: type[DateTimeTrigger] = DateTimeTrigger,
    *,
    moment: dt.datetime | None = None,
) -> Deferred:
    at = moment or dt.datetime.now(dt.UTC) + ahead
    return Deferred(
        classpath=classpath_of(cls),
        trigger_kwargs=check_kwargs({"moment": at}),
        method_name="resume",
        next_kwargs={},
        trigger_timeout=None,
        shared=True,
    )


def _defer(
    worker: WorkerService,
    sessions: sessionmaker[Session],
    broker: Broker,
    outcomes: Sequence[tuple[int, Deferred]],
) -> list[outbox.Staged]:
    """Defer running tasks as the worker records a batch of outcomes, and publish what it
    staged; returns that."""
    batch = worker_batch(worker, outcomes)
    with sessions.begin() as session:
        staged = worker.recorder.defer_many(session, batch, [])
    outbox.flush(sessions, broker, staged)
    return staged


def _trigger_of(sessions: sessionmaker[Session], ti_id: int) -> Trigger:
    with sessions() as session:
        trigger = session.scalars(
            select(Trigger)
            .join(TaskInstance, TaskInstance.trigger_id == Trigger.id)
            .where(TaskInstance.id == ti_id)
        ).one()
        session.expunge(trigger)
        return trigger


def _entries(broker: Broker) -> list[int]:
    """Trigger ids of the entries in the default queue's triggers stream, oldest first."""
    reply = broker.redis.execute_command("XRANGE", broker.keys.triggers, "-", "+")
    return [int(entry.fields[b"trigger_id"]) for entry in parse_xrange(broker.keys.triggers, reply)]


def _pending(broker: Broker) -> int:
    try:
        return broker.pending(broker.keys.triggers, GROUP_TRIGGERERS).count
    except ResponseError:  # no group yet: no triggerer has read, nothing pending
        return 0


def _age_deferrals(sessions: sessionmaker[Session]) -> None:
    """As if the tasks deferred a while ago: the reconciler leaves fresh ones alone."""
    with sessions.begin() as session:
        session.execute(text("UPDATE task_instance SET updated_at = now() - interval '1 minute'"))


def _fire(
    sessions: sessionmaker[Session], cipher: Cipher, trigger_id: int, moment: dt.datetime
) -> transitions.Resumed:
    message = event_message(cipher, trigger_id, moment, "triggerer-1")
    event = transitions.FiredEvent(message.dedup_key, trigger_id, False, moment)
    with sessions.begin() as session:
        return transitions.resume(session, event, cipher)


def _resumes(sessions: sessionmaker[Session], ti_id: int) -> int:
    with sessions() as session:
        return (
            session.scalar(
                select(func.count())
                .select_from(TaskStateChange)
                .where(
                    TaskStateChange.task_instance_id == ti_id,
                    TaskStateChange.from_state == "deferred",
                    TaskStateChange.to_state == "scheduled",
                )
            )
            or 0
        )


def test_a_far_timer_waits_as_a_row_until_near_then_is_published_and_resumed_once(
    settings: Settings,
    sessions: sessionmaker[Session],
    cipher: Cipher,
    broker: Broker,
    worker: WorkerService,
    stream_prefix: str,
    redis_url: str,
) -> None:
    far, near = running_task(sessions, run_id="far"), running_task(sessions, run_id="near")
    hour = _time_trigger(dt.timedelta(hours=1))
    staged = _defer(
        worker, sessions, broker, [(far, hour), (near, _time_trigger(dt.timedelta(minutes=5)))]
    )

    far_trigger, near_trigger = _trigger_of(sessions, far), _trigger_of(sessions, near)
    assert far_trigger.far_moment is not None and near_trigger.far_moment is None
    assert [entry.fields["trigger_id"] for entry in staged] == [str(near_trigger.id)]
    assert _entries(broker) == [near_trigger.id]  # nothing in Redis for the far timer
    assert _pending(broker) == 0
    with sessions() as session:
        said = _explain_deferred(
            session, settings, session.get_one(TaskInstance, far), dt.datetime.now(dt.UTC)
        )
    assert said[1].startswith("  a far timer, waiting as a row until ")

    # Redis loses everything: the reconciler republishes the near trigger, not the far one, and
    # the doctor does not count the far one as lost.
    delete_stream_keys(redis_url, stream_prefix)
    _age_deferrals(sessions)
    assert _not_in_flight(broker, settings) == ["factory_dag.near.t"]
    Reconciler(sessions, broker, cipher, settings.heartbeat_sec).reconcile()
    assert _entries(broker) == [near_trigger.id]
    assert _not_in_flight(broker, settings) == []

    # Not yet within the horizon: the pass publishes nothing.
    assert horizon_pass.publish_all_due(sessions, broker, cipher, HORIZON) == 0
    assert _entries(broker) == [near_trigger.id]

    # An hour later (the horizon reaching the moment): published once, with the task it names.
    later = HORIZON + dt.timedelta(hours=1)
    assert horizon_pass.publish_all_due(sessions, broker, cipher, later) == 1
    assert horizon_pass.publish_all_due(sessions, broker, cipher, later) == 0
    assert _entries(broker) == [near_trigger.id, far_trigger.id]
    assert _trigger_of(sessions, far).far_moment is None
    Reconciler(sessions, broker, cipher, settings.heartbeat_sec).reconcile()  # finds it there
    assert _entries(broker) == [near_trigger.id, far_trigger.id]

    moment = far_trigger.far_moment
    assert _fire(sessions, cipher, far_trigger.id, moment).outcome == "applied"
    assert _fire(sessions, cipher, far_trigger.id, moment).outcome == "duplicate"
    assert _resumes(sessions, far) == 1
    with sessions() as session:
        assert session.get(TaskInstance, far).state == TaskState.SCHEDULED  # type: ignore[union-attr]


def test_a_crash_between_publish_and_commit_publishes_again_and_replicas_skip_locked_rows(
    sessions: sessionmaker[Session],
    cipher: Cipher,
    broker: Broker,
    worker: WorkerService,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    ti_ids = [running_task(sessions, run_id=f"r{i}") for i in range(3)]
    _defer(
        worker,
        sessions,
        broker,
        [(ti, _time_trigger(dt.timedelta(hours=1, seconds=i))) for i, ti in enumerate(ti_ids)],
    )
    later = dt.timedelta(hours=2)

    def crash(session: Session, trigger_ids: Sequence[int]) -> None:
        raise ConnectionError("the scheduler died after XADD")

    with monkeypatch.context() as patched:
        patched.setattr(far_timers, "mark_published", crash)
        with pytest.raises(ConnectionError):
            horizon_pass.publish_due(sessions, broker, cipher, later, limit=1)
    (first,) = _entries(broker)
    assert _trigger_of(sessions, ti_ids[0]).far_moment is not None  # not marked: rolled back

    # Another replica holds the first page locked: this one takes the rest, not it.
    with sessions.begin() as holding:
        assert far_timers.take_due(holding, later, limit=1).trigger_ids == [first]
        assert horizon_pass.publish_all_due(sessions, broker, cipher, later) == 2
    assert horizon_pass.publish_all_due(sessions, broker, cipher, later) == 1  # the crashed one
    # Each trigger published once, the one whose mark was lost twice (a harmless duplicate).
    entries = _entries(broker)
    assert sorted(entries) == sorted([first, *{_trigger_of(sessions, t).id for t in ti_ids}])
    assert horizon_pass.publish_all_due(sessions, broker, cipher, later) == 0


def test_shared_far_timers_wait_on_one_row_published_once_and_resume_every_waiter(
    sessions: sessionmaker[Session], cipher: Cipher, broker: Broker, worker: WorkerService
) -> None:
    ti_ids = [running_task(sessions, run_id=f"r{i}") for i in range(4)]
    moment = dt.datetime.now(dt.UTC) + dt.timedelta(hours=1)
    _defer(
        worker, sessions, broker, [(ti, _time_trigger(HORIZON, moment=moment)) for ti in ti_ids[:2]]
    )
    _defer(
        worker, sessions, broker, [(ti, _time_trigger(HORIZON, moment=moment)) for ti in ti_ids[2:]]
    )
    (trigger_id,) = {_trigger_of(sessions, ti).id for ti in ti_ids}
    assert _entries(broker) == []

    assert horizon_pass.publish_all_due(sessions, broker, cipher, dt.timedelta(hours=2)) == 1
    assert _entries(broker) == [trigger_id]
    result = _fire(sessions, cipher, trigger_id, moment)
    assert sorted(result.ids()) == sorted(ti_ids)


def test_the_stored_classpath_is_the_class_the_task_deferred_on(
    sessions: sessionmaker[Session], cipher: Cipher, broker: Broker, worker: WorkerService
) -> None:
    delta, file = running_task(sessions, run_id="delta"), running_task(sessions, run_id="file")
    spec = FileTrigger("/nonexistent/far", poll_interval=3600).serialize()
    polls = Deferred(spec[0], check_kwargs(spec[1]), "resume", {}, None)
    _defer(
        worker,
        sessions,
        broker,
        [(delta, _time_trigger(dt.timedelta(hours=1), TimeDeltaTrigger)), (file, polls)],
    )
    delta_trigger, file_trigger = _trigger_of(sessions, delta), _trigger_of(sessions, file)
    assert delta_trigger.classpath == "deferral.triggers.temporal.TimeDeltaTrigger"
    assert delta_trigger.far_moment is not None  # a time trigger too
    assert file_trigger.far_moment is None  # a trigger that must run is held at once
    assert _entries(broker) == [file_trigger.id]


def test_a_far_timer_whose_deferral_times_out_fails_and_is_never_published(
    sessions: sessionmaker[Session], cipher: Cipher, broker: Broker, worker: WorkerService
) -> None:
    ti = running_task(sessions)
    timing_out = Deferred(
        classpath_of(DateTimeTrigger),
        check_kwargs({"moment": dt.datetime.now(dt.UTC) + dt.timedelta(hours=1)}),
        "resume",
        {},
        trigger_timeout=dt.datetime.now(dt.UTC) - dt.timedelta(seconds=1),
        shared=False,
    )
    _defer(worker, sessions, broker, [(ti, timing_out)])
    with sessions.begin() as session:
        assert transitions.expire_deferrals(session, cipher) == [ti]
    with sessions() as session:
        task = session.get(TaskInstance, ti)
        assert task is not None
        assert (task.state, task.next_method) == (TaskState.SCHEDULED, FAIL_METHOD)
        assert session.scalar(select(func.count()).select_from(Trigger)) == 0
    assert horizon_pass.publish_all_due(sessions, broker, cipher, dt.timedelta(days=1)) == 0
    assert _entries(broker) == []
