"""Shared triggers (issue 18): tasks deferring on equal shared triggers wait on one trigger row,
one stream entry and one running trigger; its event resumes each; a waiter that leaves leaves
the others waiting; the row goes with its last waiter; a joiner racing the event is not lost."""

from __future__ import annotations

import datetime as dt
import threading

import anyio
from cryptography.fernet import Fernet
from sqlalchemy import func, select, text
from sqlalchemy.orm import Session, sessionmaker

from broker import outbox
from broker.client import Broker
from deferral.runtime import metrics
from deferral.runtime.config import Settings
from deferral.runtime.crypto import Cipher, Purpose
from deferral.runtime.serialization import check_kwargs
from deferral.states import FAIL_METHOD, TaskState
from deferral.store import transitions
from deferral.store.tables import TaskInstance, TaskStateChange, Trigger
from deferral.triggers import DateTimeTrigger
from deferral.triggers.base import classpath_of
from tests.helpers import wait_for
from tests.integration.factories import WORKER, running_task, worker_batch
from tests.servers import REDIS_URL
from triggerer.events import event_message
from triggerer.service import TriggererService
from triggerer.unwanted import unwanted
from worker import record
from worker.outcomes import Deferred
from worker.service import WorkerService

MOMENT = dt.datetime(2030, 1, 1, tzinfo=dt.UTC)


def _deferred(moment: dt.datetime = MOMENT, timeout: dt.datetime | None = None) -> Deferred:
    classpath = classpath_of(DateTimeTrigger)
    return Deferred(
        classpath=classpath,
        trigger_kwargs=check_kwargs({"moment": moment}),
        method_name="resume",
        next_kwargs={},
        trigger_timeout=timeout,
        shared=DateTimeTrigger.shared,
    )


def _defer(
    sessions: sessionmaker[Session], cipher: Cipher, ti_ids: list[int], **kwargs: object
) -> tuple[dict[int, int], set[int]]:
    joined: set[int] = set()
    with sessions.begin() as session:
        specs = [
            record.deferral_of(transitions.Attempt(ti, 1, WORKER), _deferred(**kwargs), cipher)  # type: ignore[arg-type]
            for ti in ti_ids
        ]
        moved = transitions.defer_many(session, specs, joined)
    return moved, joined


def _waiters(sessions: sessionmaker[Session], count: int) -> list[int]:
    return [running_task(sessions, run_id=f"r{i}") for i in range(count)]


def _states(sessions: sessionmaker[Session], ti_ids: list[int]) -> dict[int, str]:
    with sessions() as session:
        rows = session.execute(
            select(TaskInstance.id, TaskInstance.state).where(TaskInstance.id.in_(ti_ids))
        )
        return {row.id: row.state for row in rows}


def _trigger_count(sessions: sessionmaker[Session]) -> int:
    with sessions() as session:
        return session.scalar(select(func.count()).select_from(Trigger)) or 0


def _blocked_on_a_lock(sessions: sessionmaker[Session]) -> bool:
    with sessions() as session:
        waiting = session.scalar(
            text(
                "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
                " AND datname = current_database()"
            )
        )
    return bool(waiting)


def _fire(sessions: sessionmaker[Session], cipher: Cipher, trigger_id: int) -> transitions.Resumed:
    message = event_message(cipher, trigger_id, MOMENT, "triggerer-1")
    event = transitions.FiredEvent(message.dedup_key, trigger_id, False, MOMENT)
    with sessions.begin() as session:
        return transitions.resume(session, event, cipher)


def test_equal_deferrals_share_one_trigger_and_its_event_resumes_every_waiter(
    sessions: sessionmaker[Session], cipher: Cipher
) -> None:
    ti_ids = _waiters(sessions, 30)
    moved, joined = _defer(sessions, cipher, ti_ids[:20])
    more, joined_later = _defer(sessions, cipher, ti_ids[20:])  # a later batch joins too
    assert len(set(moved.values()) | set(more.values())) == 1
    (trigger_id,) = set(moved.values())
    # One task publishes the trigger's entry; the 29 others joined it.
    assert joined | joined_later == set(ti_ids) - {min(ti_ids)}
    assert _trigger_count(sessions) == 1
    with sessions() as session:
        row = session.get(Trigger, trigger_id)
        assert row is not None and row.share_key is not None
        assert MOMENT.isoformat()[:4] not in row.share_key  # a digest, not the kwargs

    result = _fire(sessions, cipher, trigger_id)

    assert result.outcome == "applied"
    assert {result.task_instance_id, *result.others} == set(ti_ids)
    assert set(_states(sessions, ti_ids).values()) == {TaskState.SCHEDULED}
    assert _trigger_count(sessions) == 0
    with sessions() as session:
        changes = session.scalar(
            select(func.count())
            .select_from(TaskStateChange)
            .where(
                TaskStateChange.to_state == "scheduled", TaskStateChange.from_state == "deferred"
            )
        )
    assert changes == 30


def test_unequal_deferrals_and_unshared_triggers_each_get_their_own(
    sessions: sessionmaker[Session], cipher: Cipher
) -> None:
    ti_ids = _waiters(sessions, 3)
    _defer(sessions, cipher, ti_ids[:1])
    _defer(sessions, cipher, ti_ids[1:2], moment=MOMENT + dt.timedelta(microseconds=1))
    with sessions.begin() as session:
        spec = record.deferral_of(
            transitions.Attempt(ti_ids[2], 1, WORKER),
            Deferred("x.Unshared", {"moment": MOMENT.isoformat()}, "resume", {}, None),
            cipher,
        )
        assert spec.share_key is None
        transitions.defer_many(session, [spec])
    assert _trigger_count(sessions) == 3


def test_the_share_key_is_keyed_and_kwargs_order_does_not_matter(fernet_key: str) -> None:
    one, other = Cipher([fernet_key]), Cipher([Fernet.generate_key().decode()])
    path = classpath_of(DateTimeTrigger)
    key = transitions.share_key(one, path, {"a": 1, "b": 2})
    assert key == transitions.share_key(one, path, {"b": 2, "a": 1})
    assert key != transitions.share_key(other, path, {"a": 1, "b": 2})
    assert key != transitions.share_key(one, path, {"a": 1, "b": 3})
    assert key != one.sign(
        Purpose.STREAM_ENTRY, b""
    )  # a key of its own, not the stream entries' MAC


def test_a_waiter_that_leaves_does_not_cancel_the_others_and_the_last_one_drops_it(
    settings: Settings, sessions: sessionmaker[Session], cipher: Cipher
) -> None:
    past = dt.datetime.now(dt.UTC) - dt.timedelta(seconds=1)
    ti_ids = _waiters(sessions, 4)
    moved, _ = _defer(sessions, cipher, ti_ids[:3])
    _defer(sessions, cipher, ti_ids[3:], timeout=past)
    trigger_id = moved[ti_ids[0]]
    triggerer = TriggererService(settings, capacity=10, name="t1")

    # The first waiter (the one the triggerer started the trigger for) is cleared; the last
    # one times out.
    with sessions.begin() as session:
        ti = session.get(TaskInstance, ti_ids[0])
        assert ti is not None and transitions.clear(session, ti, 0)
    with sessions.begin() as session:
        assert transitions.expire_deferrals(session, cipher, among=ti_ids) == [ti_ids[3]]
    with sessions.begin() as session:
        assert transitions.drop_unwaited(session) == ([], 0)
    assert _trigger_count(sessions) == 1
    assert unwanted(triggerer.sessions, [trigger_id], [ti_ids[0]]) == {}
    assert _states(sessions, ti_ids[1:3]) == {ti_ids[1]: "deferred", ti_ids[2]: "deferred"}
    with sessions() as session:
        expired = session.get(TaskInstance, ti_ids[3])
        assert expired is not None and expired.next_method == FAIL_METHOD

    # The last waiters leave: the triggerer cancels it, the scheduler drops its row.
    with sessions.begin() as session:
        for ti_id in ti_ids[1:3]:
            ti = session.get(TaskInstance, ti_id)
            assert ti is not None and transitions.mark(session, ti, TaskState.SUCCESS)
    assert list(unwanted(triggerer.sessions, [trigger_id], [ti_ids[0]])) == [trigger_id]
    with sessions.begin() as session:
        assert transitions.drop_unwaited(session) == ([trigger_id], 0)
    assert _trigger_count(sessions) == 0


def test_a_waiter_joining_while_the_trigger_fires_waits_on_a_new_one(
    sessions: sessionmaker[Session], cipher: Cipher, broker: Broker
) -> None:
    ti_ids = _waiters(sessions, 3)
    moved, _ = _defer(sessions, cipher, ti_ids[:2])
    trigger_id = moved[ti_ids[0]]
    message = event_message(cipher, trigger_id, MOMENT, "triggerer-1")
    event = transitions.FiredEvent(message.dedup_key, trigger_id, False, MOMENT)
    joined: list[tuple[dict[int, int], set[int]]] = []
    with sessions.begin() as session:
        result = transitions.resume(session, event, cipher)  # the shared row locked till commit
        joiner = threading.Thread(
            target=lambda: joined.append(_defer(sessions, cipher, ti_ids[2:]))
        )
        joiner.start()
        wait_for(lambda: _blocked_on_a_lock(sessions), what="the joiner waiting for the lock")
    joiner.join(timeout=30)

    assert result.outcome == "applied"
    assert {result.task_instance_id, *result.others} == set(ti_ids[:2])
    ((late, late_joined),) = joined
    assert late[ti_ids[2]] != trigger_id and late_joined == set()  # made anew, published
    assert _states(sessions, ti_ids)[ti_ids[2]] == "deferred"


def test_the_worker_publishes_one_entry_and_the_triggerer_holds_one_trigger(
    settings: Settings,
    sessions: sessionmaker[Session],
    cipher: Cipher,
    broker: Broker,
    worker: WorkerService,
) -> None:
    ti_ids = _waiters(sessions, 50)
    outcome = _deferred(moment=dt.datetime.now(dt.UTC) + dt.timedelta(days=1))
    batch = worker_batch(worker, [(ti, outcome) for ti in ti_ids])
    with sessions.begin() as session:
        staged = worker.recorder.defer_many(session, batch[:30], [])
    with sessions.begin() as session:
        staged += worker.recorder.defer_many(session, batch[30:], [])
    outbox.flush(sessions, broker, staged)
    assert broker.redis.xlen(broker.keys.triggers) == 1
    assert set(_states(sessions, ti_ids).values()) == {"deferred"}

    triggerer = TriggererService(settings, capacity=100, name="t1")
    triggerer.attach(Broker.from_url(REDIS_URL, settings.stream_prefix))
    triggerer.consumer.start()

    async def one_read() -> None:
        async with anyio.create_task_group() as tasks:
            await triggerer.starter.start_all(tasks, triggerer.consumer.poll(100, None))
            tasks.cancel_scope.cancel()

    anyio.run(one_read)
    assert len(triggerer.held) == 1
    (gauge,) = metrics.TRIGGERS_RUNNING.collect()
    assert [sample.value for sample in gauge.samples] == [1]  # deferral_triggers_running


def test_the_unwaited_sweep_reads_a_page_at_a_time_and_goes_round(
    sessions: sessionmaker[Session],
) -> None:
    """Each call reads one page of shared rows: an unwaited row past the first page is dropped
    by a later call, and the sweep starts again from the first row after the last page."""
    with sessions.begin() as session:
        ids = list(
            session.scalars(
                text(
                    "INSERT INTO trigger (classpath, kwargs, share_key)"
                    " SELECT 'x.Trigger', 'sealed', 'key' || n FROM generate_series(1, 5) AS n"
                    " RETURNING id"
                )
            )
        )
    with sessions.begin() as session:
        session.execute(
            text(
                "INSERT INTO task_instance (dag_id, run_id, task_id, state, trigger_id)"
                " VALUES ('d', 'r', 'waits', 'deferred', :id)"
            ),
            {"id": ids[1]},
        )
    pages = []
    after = 0
    for _ in range(3):
        with sessions.begin() as session:
            dropped, after = transitions.drop_unwaited(session, after, page=2)
        pages.append((dropped, after))
    assert pages == [([ids[0]], ids[1]), ([ids[2], ids[3]], ids[3]), ([ids[4]], 0)]
    assert _trigger_count(sessions) == 1  # the waited one
