"""The scheduler's DAG-run work against real Postgres and Redis, one step at a time."""

from __future__ import annotations

import dataclasses
import datetime as dt
import os
import threading
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import event, select, text
from sqlalchemy.orm import Session, sessionmaker

from broker.client import Broker
from broker.streams import QueueMessage, from_fields
from deferral.runtime.config import Settings
from deferral.store import transitions
from deferral.store.tables import DagRun, Outbox, Pool, TaskInstance
from deferral.store.transitions import Attempt
from scheduler import decide as scheduler_decide
from scheduler import service as scheduler_service
from scheduler import waiting as scheduler_waiting
from scheduler.service import SchedulerService
from tests.helpers import lock_waiters, wait_for
from tests.servers import REDIS_URL

WriteDag = Callable[[str, str], Path]


def _dag_file(dag_id: str, body: str, dag_args: str = "") -> str:
    return f"""
import dataclasses
import datetime as dt
from deferral import DAG
from deferral.operators import EmptyOperator

with DAG("{dag_id}"{dag_args}) as dag:
{body}
"""


@pytest.fixture
def dag_id() -> str:
    return f"sched_{uuid.uuid4().hex[:8]}"


def _trigger(sessions: sessionmaker[Session], dag_id: str) -> None:
    with sessions.begin() as session:
        transitions.create_dag_run(session, dag_id, "r1", dt.datetime.now(dt.UTC), {})


def _states(sessions: sessionmaker[Session]) -> dict[str, str]:
    with sessions() as session:
        return {ti.task_id: ti.state for ti in session.scalars(select(TaskInstance))}


def _run_state(sessions: sessionmaker[Session]) -> str:
    with sessions() as session:
        return session.scalars(select(DagRun.state)).one()


def _queued_messages(broker: Broker, queue: str = "default") -> list[QueueMessage]:
    return [from_fields(QueueMessage, e.fields) for e in broker.xrange(broker.keys.queue(queue))]


def _start(session: Session, task_id: str) -> Attempt:
    ti = session.scalars(select(TaskInstance).where(TaskInstance.task_id == task_id)).one()
    assert transitions.start_many(session, [(ti.id, ti.try_number)], "host", "w")
    return Attempt(ti.id, ti.try_number, "w")


def _finish(sessions: sessionmaker[Session], task_id: str, *, ok: bool = True) -> None:
    """What a worker does with the queued attempt of ``task_id``."""
    with sessions.begin() as session:
        attempt = _start(session, task_id)
        if ok:
            assert transitions.succeed(session, attempt, None)
        else:
            assert transitions.fail(session, attempt, "boom", allow_retry=True)


def _scheduler(settings: Settings) -> SchedulerService:
    """A scheduler that has read the DAGs folder (a running one reads it off its loop)."""
    service = SchedulerService(settings, name="s")
    service.attach(Broker.from_url(REDIS_URL, settings.stream_prefix))
    service.refresh_dags()
    return service


def _step(service: SchedulerService) -> None:
    """The scheduler's loop without its periodic work or events, but for waking retries."""
    service.start_queued_runs()
    service.evaluate_marked_runs()
    service.housekeeping.wake_due()
    service.dispatch_scheduled()


def test_run_dispatches_by_dependencies_and_finishes(
    settings: Settings,
    sessions: sessionmaker[Session],
    broker: Broker,
    write_dag: WriteDag,
    dag_id: str,
) -> None:
    write_dag(
        dag_id,
        _dag_file(
            dag_id,
            """
    a = EmptyOperator(task_id="a", priority_weight=1)
    c = EmptyOperator(task_id="c", priority_weight=5)
    a >> EmptyOperator(task_id="b")
""",
        ),
    )
    service = _scheduler(settings)
    _trigger(sessions, dag_id)

    _step(service)
    assert _states(sessions) == {"a": "queued", "b": "none", "c": "queued"}
    messages = _queued_messages(broker)
    # Higher priority first; labels and try numbers as workers expect them.
    assert [m.task for m in messages] == [f"{dag_id}.r1.c", f"{dag_id}.r1.a"]
    assert {m.try_number for m in messages} == {"1"}
    with sessions() as session:
        assert all(row.published_at for row in session.scalars(select(Outbox)))

    _finish(sessions, "a")
    _step(service)
    assert _states(sessions)["b"] == "queued"
    _finish(sessions, "b")
    _finish(sessions, "c")
    _step(service)
    assert _run_state(sessions) == "success"


def test_failure_propagates_upstream_failed_and_fails_the_run(
    settings: Settings, sessions: sessionmaker[Session], write_dag: WriteDag, dag_id: str
) -> None:
    write_dag(
        dag_id,
        _dag_file(
            dag_id,
            """
    a = EmptyOperator(task_id="a")
    a >> EmptyOperator(task_id="b") >> EmptyOperator(task_id="c")
    a >> EmptyOperator(task_id="cleanup", trigger_rule="all_done")
""",
        ),
    )
    service = _scheduler(settings)
    _trigger(sessions, dag_id)
    _step(service)
    _finish(sessions, "a", ok=False)
    _step(service)
    assert _states(sessions) == {
        "a": "failed",
        "b": "upstream_failed",
        "c": "upstream_failed",
        "cleanup": "queued",
    }
    _finish(sessions, "cleanup")
    _step(service)
    assert _run_state(sessions) == "failed"


def test_a_failed_try_is_retried_as_a_new_try(
    settings: Settings,
    sessions: sessionmaker[Session],
    broker: Broker,
    write_dag: WriteDag,
    dag_id: str,
) -> None:
    write_dag(
        dag_id,
        _dag_file(
            dag_id,
            """
    EmptyOperator(task_id="a", retries=1, retry_delay=dt.timedelta(0))
""",
        ),
    )
    service = _scheduler(settings)
    _trigger(sessions, dag_id)
    _step(service)
    _finish(sessions, "a", ok=False)
    assert _states(sessions) == {"a": "up_for_retry"}
    _step(service)
    assert _states(sessions) == {"a": "queued"}
    assert [m.try_number for m in _queued_messages(broker)] == ["1", "2"]
    _finish(sessions, "a", ok=False)
    assert _states(sessions) == {"a": "failed"}  # retries used up


def test_max_active_tasks_limits_dispatch(
    settings: Settings, sessions: sessionmaker[Session], write_dag: WriteDag, dag_id: str
) -> None:
    body = "\n".join(f'    EmptyOperator(task_id="t{i}")' for i in range(4))
    write_dag(dag_id, _dag_file(dag_id, body, dag_args=", max_active_tasks=2"))
    service = _scheduler(settings)
    _trigger(sessions, dag_id)
    _step(service)
    assert sorted(_states(sessions).values()).count("queued") == 2
    _step(service)
    assert sorted(_states(sessions).values()).count("queued") == 2


def test_a_marked_run_in_which_nothing_can_be_decided_is_only_unmarked(
    settings: Settings, sessions: sessionmaker[Session], write_dag: WriteDag, dag_id: str
) -> None:
    write_dag(
        dag_id, _dag_file(dag_id, '    EmptyOperator(task_id="a")\n    EmptyOperator(task_id="b")')
    )
    service = _scheduler(settings)
    _trigger(sessions, dag_id)
    _step(service)
    _finish(sessions, "b")  # marks the run; "a" is still queued
    with sessions() as session:
        assert session.scalars(select(DagRun.evaluate_after)).one() is not None

    service.evaluate_marked_runs()

    assert _states(sessions) == {"a": "queued", "b": "success"}
    with sessions() as session:
        run = session.scalars(select(DagRun)).one()
        assert (run.state, run.evaluate_after) == ("running", None)
    _finish(sessions, "a")
    _step(service)
    assert _run_state(sessions) == "success"


def _run_then_task_added(
    settings: Settings, sessions: sessionmaker[Session], write_dag: WriteDag, dag_id: str
) -> SchedulerService:
    """A run of a DAG of task "a", then "late" added to the DAG file and "a" done."""
    path = write_dag(dag_id, _dag_file(dag_id, '    EmptyOperator(task_id="a")'))
    service = _scheduler(settings)
    _trigger(sessions, dag_id)
    _step(service)
    write_dag(
        dag_id,
        _dag_file(dag_id, '    EmptyOperator(task_id="a") >> EmptyOperator(task_id="late")'),
    )
    stat = path.stat()
    os.utime(path, (stat.st_atime, stat.st_mtime + 5))
    service.refresh_dags()
    _finish(sessions, "a")
    return service


def test_a_task_added_to_the_dag_mid_run_joins_the_run(
    settings: Settings,
    sessions: sessionmaker[Session],
    write_dag: WriteDag,
    dag_id: str,
) -> None:
    service = _run_then_task_added(settings, sessions, write_dag, dag_id)
    _step(service)
    assert _states(sessions) == {"a": "success", "late": "queued"}
    assert _run_state(sessions) == "running"


def test_a_task_added_mid_run_joins_it_after_the_evaluation_that_added_it_rolled_back(
    settings: Settings,
    sessions: sessionmaker[Session],
    write_dag: WriteDag,
    dag_id: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The evaluation that adds the task raises after adding it (its savepoint rolls the new
    task instance back): the run must be checked against the DAG again, not remembered as
    complete, which finished it SUCCESS without ever running the new task."""
    service = _run_then_task_added(settings, sessions, write_dag, dag_id)
    advance = scheduler_waiting.advance

    def failing_once(*args: Any, **kwargs: Any) -> Any:
        monkeypatch.setattr(scheduler_waiting, "advance", advance)
        raise RuntimeError("a bug met once")

    monkeypatch.setattr(scheduler_waiting, "advance", failing_once)
    _step(service)
    assert _states(sessions) == {"a": "success"}
    with sessions.begin() as session:  # its next look, without waiting for the retry delay
        session.scalars(select(DagRun)).one().evaluate_after = dt.datetime.now(dt.UTC)
    _step(service)
    assert _states(sessions) == {"a": "success", "late": "queued"}
    assert _run_state(sessions) == "running"


def _set_pool(sessions: sessionmaker[Session], slots: int, include_deferred: bool) -> None:
    with sessions.begin() as session:
        session.merge(Pool(name="small", slots=slots, include_deferred=include_deferred))


def _defer(sessions: sessionmaker[Session], task_id: str) -> None:
    """What a worker does when the queued attempt of ``task_id`` defers."""
    with sessions.begin() as session:
        attempt = _start(session, task_id)
        trigger_id = transitions.create_trigger(session, "x.Trigger", "token")
        transitions.defer(
            session,
            attempt,
            trigger_id=trigger_id,
            next_method="resume",
            next_kwargs_token="token",
            trigger_timeout=None,
        )


@pytest.mark.parametrize("include_deferred", [False, True])
def test_pools_limit_dispatch_and_deferred_tasks_free_their_slot_by_default(
    settings: Settings,
    sessions: sessionmaker[Session],
    write_dag: WriteDag,
    dag_id: str,
    include_deferred: bool,
) -> None:
    body = "\n".join(
        f'    EmptyOperator(task_id="t{i}", pool="small", priority_weight={9 - i})'
        for i in range(3)
    )
    write_dag(dag_id, _dag_file(dag_id, body))
    _set_pool(sessions, slots=1, include_deferred=include_deferred)
    service = _scheduler(settings)
    _trigger(sessions, dag_id)
    _step(service)
    assert _states(sessions) == {"t0": "queued", "t1": "scheduled", "t2": "scheduled"}

    _defer(sessions, "t0")
    _step(service)
    expected_t1 = "scheduled" if include_deferred else "queued"
    assert _states(sessions) == {"t0": "deferred", "t1": expected_t1, "t2": "scheduled"}


def _two_schedulers_queue_at_once(
    settings: Settings, sessions: sessionmaker[Session], path: str, slots: dict[str, int]
) -> list[str]:
    """t0 and t1 of a triggered run, scheduled while their pools had no slot, then queued by
    two schedulers at once after the pools get ``slots``: the first holds its transaction open
    until the second waits for a lock (or is done without one); the states of both after."""
    first, second = _scheduler(settings), _scheduler(settings)
    _step(first)
    assert _states(sessions) == {"t0": "scheduled", "t1": "scheduled"}
    with sessions.begin() as session:
        for name, count in slots.items():
            session.execute(
                text("UPDATE pool SET slots = :slots WHERE name = :name"),
                {"slots": count, "name": name},
            )
    with sessions() as session:
        ids = {t: i for t, i in session.execute(select(TaskInstance.task_id, TaskInstance.id))}

    def dispatch(service: SchedulerService, session: Session, task_id: str) -> None:
        if path == "dispatch":
            service.dispatcher.scheduled(session)
        else:
            service.dispatcher.resumed(session, [ids[task_id]])

    def second_dispatches() -> None:
        with sessions.begin() as session:
            dispatch(second, session, "t1")

    with sessions.begin() as session:
        dispatch(first, session, "t0")
        waiter = threading.Thread(target=second_dispatches)
        waiter.start()
        wait_for(
            lambda: lock_waiters(sessions) == 1 or not waiter.is_alive(),
            timeout=30,
            what="the second to wait for a lock or finish",
        )
    waiter.join(timeout=30)
    assert not waiter.is_alive()
    return sorted(_states(sessions).values())


# The pool case: the second waits for the pool's lock while the first queues into its last
# slot, and must count what the first queued once it has the lock (a count read in the statement
# that waited missed it: both queued into the 1-slot pool). The run case: two tasks of a run of
# max_active_tasks=1, in pools of their own: the second must count what the first queued into
# the run (counted before any lock, the resume path queued both).
_AT_ONCE = {
    "pool": ('    EmptyOperator(task_id="t0", pool="small")', "small", "", {"small": 1}),
    "run": (
        '    EmptyOperator(task_id="t0", pool="small")',
        "other",
        ", max_active_tasks=1",
        {"small": 1, "other": 1},
    ),
}


@pytest.mark.parametrize("limit", ["pool", "run"])
@pytest.mark.parametrize("path", ["dispatch", "resume"])
def test_two_schedulers_queueing_at_once_keep_pool_slots_and_max_active_tasks(
    settings: Settings,
    sessions: sessionmaker[Session],
    write_dag: WriteDag,
    dag_id: str,
    path: str,
    limit: str,
) -> None:
    first_task, second_pool, dag_args, slots = _AT_ONCE[limit]
    body = f'{first_task}\n    EmptyOperator(task_id="t1", pool="{second_pool}")'
    write_dag(dag_id, _dag_file(dag_id, body, dag_args=dag_args))
    with sessions.begin() as session:
        for name in slots:
            session.merge(Pool(name=name, slots=0, include_deferred=False))
    _trigger(sessions, dag_id)
    assert _two_schedulers_queue_at_once(settings, sessions, path, slots) == [
        "queued",
        "scheduled",
    ]


def test_a_resumed_task_is_queued_in_four_statements(
    settings: Settings,
    sessions: sessionmaker[Session],
    write_dag: WriteDag,
    dag_id: str,
) -> None:
    """On every resume's path: the task, its run and its pool locked; the run's active tasks
    and the pool's free slots counted together; the move; its queue entry staged."""
    write_dag(dag_id, _dag_file(dag_id, '    EmptyOperator(task_id="t0", pool="small")'))
    with sessions.begin() as session:
        session.merge(Pool(name="small", slots=0, include_deferred=False))
    _trigger(sessions, dag_id)
    service = _scheduler(settings)
    _step(service)
    with sessions.begin() as session:
        session.execute(text("UPDATE pool SET slots = 1 WHERE name = 'small'"))
    with sessions() as session:
        (ti_id,) = session.scalars(select(TaskInstance.id)).all()
    statements: list[str] = []

    def seen(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        statements.append(statement)

    event.listen(service.engine, "before_cursor_execute", seen)
    try:
        with service.sessions.begin() as session:
            staged = service.dispatcher.resumed(session, [ti_id])
    finally:
        event.remove(service.engine, "before_cursor_execute", seen)
    assert len(staged) == 1
    assert len(statements) == 4, statements
    assert _states(sessions) == {"t0": "queued"}


def test_a_run_at_max_active_tasks_does_not_hold_back_other_runs_tasks(
    settings: Settings, sessions: sessionmaker[Session], write_dag: WriteDag, dag_id: str
) -> None:
    """The run whose tasks come first by priority can only take one more slot: the others'
    tasks get the rest, this loop and the next (it is left out of the query once full)."""
    busy, other = f"{dag_id}_busy", f"{dag_id}_other"
    body = "\n".join(
        f'    EmptyOperator(task_id="b{i}", pool="small", priority_weight=10)' for i in range(5)
    )
    write_dag(busy, _dag_file(busy, body, dag_args=", max_active_tasks=1"))
    body = "\n".join(f'    EmptyOperator(task_id="o{i}", pool="small")' for i in range(3))
    write_dag(other, _dag_file(other, body))
    _set_pool(sessions, slots=3, include_deferred=False)
    service = _scheduler(settings)
    _trigger(sessions, busy)
    _trigger(sessions, other)
    _step(service)
    states = _states(sessions)
    assert sorted(t for t, s in states.items() if s == "queued") == ["b0", "o0", "o1"]

    _finish(sessions, "o0")
    _step(service)
    states = _states(sessions)
    assert sorted(t for t, s in states.items() if s == "queued") == ["b0", "o1", "o2"]


def test_a_task_too_big_for_its_pools_room_does_not_block_smaller_ones(
    settings: Settings, sessions: sessionmaker[Session], write_dag: WriteDag, dag_id: str
) -> None:
    body = '    EmptyOperator(task_id="big", pool="small", pool_slots=5, priority_weight=10)\n'
    body += "\n".join(f'    EmptyOperator(task_id="s{i}", pool="small")' for i in range(3))
    write_dag(dag_id, _dag_file(dag_id, body))
    _set_pool(sessions, slots=3, include_deferred=False)
    service = _scheduler(settings)
    _trigger(sessions, dag_id)
    _step(service)
    assert _states(sessions) == {
        "big": "scheduled",
        "s0": "queued",
        "s1": "queued",
        "s2": "queued",
    }


def test_a_task_in_an_unknown_pool_waits_without_blocking_others(
    settings: Settings, sessions: sessionmaker[Session], write_dag: WriteDag, dag_id: str
) -> None:
    write_dag(
        dag_id,
        _dag_file(
            dag_id,
            """
    EmptyOperator(task_id="lost", pool="no_such_pool")
    EmptyOperator(task_id="fine")
""",
        ),
    )
    service = _scheduler(settings)
    _trigger(sessions, dag_id)
    _step(service)
    assert _states(sessions) == {"lost": "scheduled", "fine": "queued"}


def test_a_run_whose_evaluation_raises_is_marked_and_the_others_go_on(
    settings: Settings,
    sessions: sessionmaker[Session],
    write_dag: WriteDag,
    dag_id: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    write_dag(dag_id, _dag_file(dag_id, '    EmptyOperator(task_id="a")'))
    service = _scheduler(settings)
    with sessions.begin() as session:
        for run_id in ("bad", "good"):
            transitions.create_dag_run(
                session,
                dag_id,
                run_id,
                dt.datetime.now(dt.UTC) + dt.timedelta(seconds=len(run_id)),
                {},
            )
    service.start_queued_runs()
    real = scheduler_decide.waiting_decisions

    def flaky(dag: Any, states: Any, *more: Any) -> Any:
        # Evaluated together, the batch holding "bad" raises; then each run alone.
        if not _evaluating or _evaluating[0].run_id == "bad":
            raise RuntimeError("a bug met by this run only")
        return real(dag, states, *more)

    _evaluating: list[DagRun] = []
    original = service.evaluator._evaluate

    def evaluate(session: Session, run: DagRun, *more: Any) -> None:
        _evaluating[:] = [run]
        original(session, run, *more)

    monkeypatch.setattr(scheduler_decide, "waiting_decisions", flaky)
    monkeypatch.setattr(service.evaluator, "_evaluate", evaluate)
    service.evaluate_marked_runs()

    with sessions() as session:
        runs = {run.run_id: run for run in session.scalars(select(DagRun))}
        states = dict(session.execute(select(TaskInstance.run_id, TaskInstance.state)).all())
    assert states == {"bad": "none", "good": "queued"}  # scheduled and queued in that pass
    assert runs["bad"].scheduling_error == "RuntimeError: a bug met by this run only"
    assert runs["bad"].evaluate_after is not None  # looked at again later
    assert runs["good"].scheduling_error is None and runs["good"].evaluate_after is None


def test_an_event_entry_that_makes_the_reader_raise_is_dead_lettered_alone(
    settings: Settings,
    sessions: sessionmaker[Session],
    broker: Broker,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from scheduler import events

    def read(cipher: object, fields: dict[bytes, bytes]) -> object:
        raise RecursionError("maximum recursion depth exceeded")

    monkeypatch.setattr(events, "read_event", read)
    service = _scheduler(settings)
    service.consumer.start()
    odd = broker.redis.xadd(broker.keys.events, {"odd": "entry"}).decode()
    try:
        assert service.events.apply(block_ms=None) == 0
    finally:
        service.broker.close()
    (dead,) = broker.xrange(broker.keys.dead)
    assert dead.fields[b"source_id"].decode() == odd
    assert dead.fields[b"error"] == (
        b"unreadable event entry: RecursionError: maximum recursion depth exceeded"
    )
    assert int(broker.redis.xlen(broker.keys.events)) == 0


def test_a_run_of_a_dag_not_yet_looked_for_waits_and_one_looked_for_and_missing_fails(
    settings: Settings,
    sessions: sessionmaker[Session],
    broker: Broker,
    write_dag: WriteDag,
    dag_id: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # No second look within the test: the folder is read only when the test says so.
    monkeypatch.setattr(scheduler_service, "RECOLLECT_MISSING_SEC", float("inf"))
    service = _scheduler(settings)
    service.refresh_dags()
    # A file written and triggered right after that read (as `dags trigger` does within a
    # second of the scheduler's last look): the run waits for the next look, it does not fail.
    write_dag(dag_id, _dag_file(dag_id, "    EmptyOperator(task_id='a')"))
    _trigger(sessions, dag_id)
    service.start_queued_runs()
    assert _run_state(sessions) == "queued"
    service.refresh_dags()
    service.start_queued_runs()
    assert _run_state(sessions) == "running"

    with sessions.begin() as session:  # a run of a DAG no file defines, looked for since
        transitions.create_dag_run(session, "no_such_dag", "r1", dt.datetime.now(dt.UTC), {})
    service.refresh_dags()
    service.start_queued_runs()
    with sessions() as session:
        missing = session.scalars(select(DagRun).where(DagRun.dag_id == "no_such_dag")).one()
    assert missing.state == "failed"


def test_a_run_evaluated_first_by_a_scheduler_without_its_dag_stays_marked_for_one_with_it(
    settings: Settings,
    sessions: sessionmaker[Session],
    write_dag: WriteDag,
    dag_id: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two schedulers; the DAG file is written after one of them read the folder. The run that
    the other made is evaluated first by the one without the DAG: unmarked there, it waited for
    ever with its tasks in no state (seen in benchmarks/redis_faults.py)."""
    monkeypatch.setattr(scheduler_service, "RECOLLECT_MISSING_SEC", float("inf"))
    behind = _scheduler(settings)
    write_dag(dag_id, _dag_file(dag_id, "    EmptyOperator(task_id='a')"))
    ahead = _scheduler(settings)
    _trigger(sessions, dag_id)
    ahead.start_queued_runs()

    behind.evaluate_marked_runs()
    with sessions() as session:
        run = session.scalars(select(DagRun)).one()
        assert run.evaluate_after is not None  # still marked, for a later look
        assert run.scheduling_error == f"DAG {dag_id!r} is not loaded by scheduler s (yet)"
    with sessions.begin() as session:  # that later look is due
        session.scalars(select(DagRun)).one().evaluate_after = dt.datetime.now(dt.UTC)
    _step(ahead)
    assert _states(sessions) == {"a": "queued"}


@pytest.mark.parametrize("resumed_first", [True, False])
def test_a_resumed_task_is_queued_ahead_of_new_work_of_equal_weight(
    settings: Settings,
    sessions: sessionmaker[Session],
    write_dag: WriteDag,
    dag_id: str,
    resumed_first: bool,
) -> None:
    """New work fills the pool's queue (older ids, equal weight); the task resumed since goes
    first when a slot frees, unless DEFERRAL_RESUMED_FIRST is off."""
    body = "\n".join(f'    EmptyOperator(task_id="n{i}", pool="small")' for i in range(4))
    write_dag(dag_id, _dag_file(dag_id, body))
    waiter = f"{dag_id}_w"
    write_dag(waiter, _dag_file(waiter, '    EmptyOperator(task_id="w", pool="small")'))
    _set_pool(sessions, slots=0, include_deferred=False)
    service = _scheduler(dataclasses.replace(settings, resumed_first=resumed_first))
    _trigger(sessions, dag_id)
    _trigger(sessions, waiter)
    _step(service)  # every task scheduled, none queued: the pool has no slot
    with sessions.begin() as session:
        w = session.scalars(select(TaskInstance.id).where(TaskInstance.task_id == "w")).one()
        transitions.dispatch(session, [w])  # it ran before the pool filled
    _defer(sessions, "w")
    with sessions.begin() as session:
        trigger_id = session.scalar(select(TaskInstance.trigger_id).where(TaskInstance.id == w))
        assert trigger_id is not None
        event = transitions.FiredEvent("e1", trigger_id, False, {"done": True})
        assert transitions.resume(session, event, service.cipher).task_instance_id == w
    _set_pool(sessions, slots=1, include_deferred=False)
    with sessions.begin() as session:
        service.dispatcher.scheduled(session)
    queued = {task for task, state in _states(sessions).items() if state == "queued"}
    assert queued == ({"w"} if resumed_first else {"n0"})
