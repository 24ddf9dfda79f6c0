"""A queue entry whose task cannot be run fails that task with the reason and leaves the queue
moving (no crash, no entry left behind)."""

from __future__ import annotations

import datetime as dt

import pytest
from sqlalchemy import Connection, delete, event, select, update
from sqlalchemy.orm import Session, sessionmaker

from broker.client import Broker
from broker.streams import queue_message
from deferral.store import transitions
from deferral.store.tables import DagRun, TaskInstance, TaskStateChange
from deferral.store.transitions import Attempt, NewTaskInstance
from tests.integration.factories import running_task, worker_batch
from worker.outcomes import Failed
from worker.recording import Running
from worker.service import WorkerService


def _queued(sessions: sessionmaker[Session], *, next_kwargs: str | None = None) -> int:
    with sessions.begin() as session:
        transitions.create_dag_run(session, "d", "r1", dt.datetime.now(dt.UTC), {})
        run = session.scalars(select(DagRun)).one()
        transitions.start_dag_run(
            session, run, [NewTaskInstance("t", 0, "default_pool", 1, "default", 1)]
        )
        ti = session.scalars(select(TaskInstance)).one()
        ti.next_method, ti.next_kwargs = ("resume", next_kwargs) if next_kwargs else (None, None)
        transitions.schedule(session, [ti.id])
        transitions.dispatch(session, [ti.id])
        return ti.id


def _last_reason(sessions: sessionmaker[Session], ti_id: int) -> tuple[str, str | None]:
    with sessions() as session:
        change = session.scalars(
            select(TaskStateChange)
            .where(TaskStateChange.task_instance_id == ti_id)
            .order_by(TaskStateChange.id.desc())
        ).first()
        assert change is not None
        return change.to_state, change.reason


@pytest.mark.parametrize(
    "fault", ["unreadable next_kwargs", "unreadable next_event", "run deleted"]
)
def test_a_task_that_cannot_run_fails_with_the_reason(
    worker: WorkerService, sessions: sessionmaker[Session], broker: Broker, fault: str
) -> None:
    ti_id = _queued(sessions, next_kwargs="gAAAAA-not-a-token" if "kwargs" in fault else None)
    if fault == "run deleted":
        with sessions.begin() as session:
            session.execute(delete(DagRun))
    if fault == "unreadable next_event":
        with sessions.begin() as session:
            ti = session.get_one(TaskInstance, ti_id)
            ti.next_method, ti.next_event = "resume", "gAAAAA-not-a-token"
    broker.publish(worker.streams[0], queue_message(worker.cipher, ti_id, 1, "d", "r1", "t", -1))

    worker.step()

    state, reason = _last_reason(sessions, ti_id)
    assert state == "failed"
    expected = (
        "DAG run d r1 no longer exists" if fault == "run deleted" else "token failed authentication"
    )
    assert reason is not None and reason.startswith("cannot run: ") and expected in reason
    assert broker.redis.xlen(worker.streams[0]) == 0
    assert worker.running == {}


def test_an_entry_that_makes_the_reader_raise_is_dead_lettered_alone(
    worker: WorkerService,
    sessions: sessionmaker[Session],
    broker: Broker,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Not a parse error the reader expects: the entry is set aside with the exception, and the
    authentic entry read with it still starts."""
    from worker import service

    ti_id = _queued(sessions)
    odd = broker.redis.xadd(worker.streams[0], {"odd": "entry"}).decode()
    broker.publish(worker.streams[0], queue_message(worker.cipher, ti_id, 1, "d", "r1", "t", -1))
    real = service.read_queue_entry

    def read(cipher: object, fields: dict[bytes, bytes]) -> object:
        if b"odd" in fields:
            raise RecursionError("maximum recursion depth exceeded")
        return real(cipher, fields)  # type: ignore[arg-type]

    monkeypatch.setattr(service, "read_queue_entry", read)
    worker.step()

    (dead,) = broker.xrange(broker.keys.dead)
    assert dead.fields[b"source_id"].decode() == odd
    assert dead.fields[b"error"] == (
        b"unreadable queue entry: RecursionError: maximum recursion depth exceeded"
    )
    assert ti_id in worker.running


def test_an_attempt_starts_in_one_statement_committed_on_its_own(
    worker: WorkerService, sessions: sessionmaker[Session], broker: Broker
) -> None:
    """Between the entry and the task's code: no BEGIN or COMMIT round trip, only the start
    statement (which writes the start line too)."""
    ti_id = _queued(sessions)
    statements: list[tuple[bool, str]] = []

    def seen(conn: Connection, cursor: object, statement: str, *args: object) -> None:
        dbapi = conn.connection.dbapi_connection
        assert dbapi is not None
        statements.append((dbapi.autocommit, statement))

    broker.publish(worker.streams[0], queue_message(worker.cipher, ti_id, 1, "d", "r1", "t", -1))
    event.listen(worker.engine, "before_cursor_execute", seen)
    try:
        worker._start(worker.consumer.poll(1, block_ms=None))
    finally:
        event.remove(worker.engine, "before_cursor_execute", seen)

    ((autocommit, statement),) = statements
    assert autocommit and "SET state = 'running'" in statement
    assert ti_id in worker.running
    with sessions() as session:
        assert session.get_one(TaskInstance, ti_id).state == "running"


def test_an_attempt_that_cannot_run_is_recorded_with_the_outcomes_a_failed_record_left(
    worker: WorkerService, sessions: sessionmaker[Session], broker: Broker
) -> None:
    """A takeover's start runs before the step records again what a failed record left: the
    failure of an attempt that cannot run must not replace those outcomes."""
    ti_id = _queued(sessions)  # first: it expects the only run
    left_ti = running_task(sessions, task_id="left", run_id="r0")
    with sessions.begin() as session:  # the attempt runs on this worker
        session.execute(
            update(TaskInstance).where(TaskInstance.id == left_ti).values(worker=worker.name)
        )
    (left,) = worker_batch(worker, [(left_ti, Failed("boom", "", allow_retry=False))])
    worker.recorder.unrecorded = [
        (Running(left[0].delivery, Attempt(left_ti, 1, worker.name), left[0].label), left[1])
    ]
    with sessions.begin() as session:
        session.execute(delete(DagRun).where(DagRun.run_id == "r1"))
    broker.publish(worker.streams[0], queue_message(worker.cipher, ti_id, 1, "d", "r1", "t", -1))

    worker._start(worker.consumer.poll(1, block_ms=None))

    assert _last_reason(sessions, ti_id)[0] == "failed"
    assert _last_reason(sessions, left_ti) == ("failed", "boom")
    assert worker.recorder.unrecorded == []
