"""A worker takes over the queue entries of a dead worker — and fails only attempts that the dead
worker itself was running."""

from __future__ import annotations

import datetime as dt

import pytest
from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import Session, sessionmaker

from broker.client import Broker, LeaseStatus
from broker.consumer import Delivery, Lost
from broker.replies import Entry
from broker.streams import GROUP_WORKERS, queue_message
from deferral.runtime.config import Settings
from deferral.store import tasklogs, transitions
from deferral.store.tables import TaskInstance, TaskStateChange, Worker
from deferral.store.transitions import Attempt
from tests.integration.factories import DAG_ID, WORKER, queued_task, running_task
from tests.servers import REDIS_URL
from worker import service as worker_service
from worker.outcomes import Failed
from worker.recording import Running
from worker.service import WorkerService

STALE_IDLE_MS = 600_000  # far past any takeover threshold


def _held_entry(worker: WorkerService, broker: Broker, ti_id: int, owner: str, idle_ms: int) -> str:
    """A queue entry for try 1 of ``ti_id``, delivered to ``owner`` and idle for ``idle_ms``."""
    stream = worker.streams[0]
    broker.publish(stream, queue_message(worker.cipher, ti_id, 1, DAG_ID, "r1", "t", -1))
    (entry,) = broker.read(GROUP_WORKERS, owner, {stream: ">"}, count=1)
    broker.redis.execute_command(
        "XCLAIM", stream, GROUP_WORKERS, owner, 0, entry.id, "IDLE", idle_ms, "JUSTID"
    )
    return entry.id


def _register_dead(sessions: sessionmaker[Session], name: str) -> None:
    """A row for worker ``name``: it was running, and its last heartbeat came before its entries
    went idle (it died holding them), so their delivery counts are believed."""
    with sessions.begin() as session:
        session.add(
            Worker(
                name=name,
                hostname="h",
                pid=1,
                queue="default",
                concurrency=1,
                state="running",
                latest_heartbeat=dt.datetime.now(dt.UTC) - dt.timedelta(seconds=700),
            )
        )


def _ti(sessions: sessionmaker[Session], ti_id: int) -> TaskInstance:
    with sessions() as session:
        ti = session.get(TaskInstance, ti_id)
        assert ti is not None
        return ti


def test_claim_idle_takes_only_stale_entries_with_their_owner(
    worker: WorkerService, broker: Broker
) -> None:
    stream = worker.streams[0]
    stale = _held_entry(worker, broker, 1, "dead", STALE_IDLE_MS)
    _held_entry(worker, broker, 2, "alive", 0)
    gone = _held_entry(worker, broker, 3, "dead", STALE_IDLE_MS)
    broker.redis.xdel(stream, gone)  # deleted while pending: nothing to take

    claimed = broker.claim_idle(stream, GROUP_WORKERS, "me", min_idle_ms=60_000, count=10)
    assert [(c.entry.id, c.owner) for c in claimed] == [(stale, "dead")]
    assert claimed[0].entry.fields[b"task_instance_id"] == b"1"


def test_a_dead_workers_running_attempt_is_failed_into_a_retry(
    worker: WorkerService, sessions: sessionmaker[Session], broker: Broker
) -> None:
    ti_id = running_task(sessions)  # running on "worker-1", try 1, retries 0 -> failed
    with sessions.begin() as session:
        ti = session.get(TaskInstance, ti_id)
        assert ti is not None
        ti.max_tries = 1  # one retry left
    _held_entry(worker, broker, ti_id, WORKER, STALE_IDLE_MS)
    _register_dead(sessions, WORKER)

    worker._take_over()

    assert _ti(sessions, ti_id).state == "up_for_retry"
    with sessions() as session:
        last = session.query(TaskStateChange).order_by(TaskStateChange.id.desc()).first()
    assert last is not None and last.reason == "worker worker-1 stopped heartbeating"
    assert broker.redis.xlen(worker.streams[0]) == 0


def test_an_attempt_running_on_a_live_worker_is_left_alone(
    worker: WorkerService, sessions: sessionmaker[Session], broker: Broker
) -> None:
    """The same try resumed after a deferral runs on a live worker while a stale entry of the
    dead one is taken over: only the stale entry goes."""
    ti_id = running_task(sessions)  # running on "worker-1"
    _held_entry(worker, broker, ti_id, "dead-worker", STALE_IDLE_MS)
    _register_dead(sessions, "dead-worker")

    worker._take_over()

    assert _ti(sessions, ti_id).state == "running"
    assert broker.redis.xlen(worker.streams[0]) == 0
    with sessions.begin() as session:  # and the live attempt can still finish
        assert transitions.succeed(session, Attempt(ti_id, 1, WORKER), None)


def test_a_worker_restarted_under_its_name_fails_the_attempts_its_last_process_ran(
    settings: Settings, sessions: sessionmaker[Session]
) -> None:
    """Even one whose queue entry Redis lost: nothing would replay it, and the name heartbeats
    again, so the reconciler would take it for a live attempt."""
    ours = running_task(sessions, task_id="ours")  # running on WORKER, no queue entry anywhere
    theirs = running_task(sessions, task_id="theirs", run_id="r2")
    with sessions.begin() as session:
        session.get_one(TaskInstance, ours).max_tries = 1  # one retry left
        session.get_one(TaskInstance, theirs).worker = "another-worker"
    restarted = WorkerService(settings, queues=("default",), concurrency=1, name=WORKER)
    restarted.attach(Broker.from_url(REDIS_URL, settings.stream_prefix))
    try:
        restarted._begin()
    finally:
        restarted.pool.shutdown()
        restarted.broker.close()
    assert _ti(sessions, ours).state == "up_for_retry"
    assert _ti(sessions, theirs).state == "running"
    with sessions() as session:
        lines = tasklogs.read_lines(session, ours, 1)
    assert lines[-1].text == (
        f"worker {WORKER} restarted: the attempt's process died with it; now up_for_retry"
    )


def test_an_attempt_handed_back_runs_again_at_the_same_try(
    sessions: sessionmaker[Session],
) -> None:
    ti_id = running_task(sessions)  # running on "worker-1", try 1
    with sessions.begin() as session:
        # Fenced: another worker's or another try's hand-back moves nothing.
        assert transitions.hand_back(session, [Attempt(ti_id, 1, "worker-2")], "r") == []
        assert transitions.hand_back(session, [Attempt(ti_id, 2, WORKER)], "r") == []
        assert transitions.hand_back(session, [Attempt(ti_id, 1, WORKER)], "handed back") == [ti_id]
        assert transitions.hand_back(session, [Attempt(ti_id, 1, WORKER)], "again") == []
    ti = _ti(sessions, ti_id)
    assert (ti.state, ti.try_number, ti.end_date) == ("scheduled", 1, None)
    with sessions.begin() as session:
        (queued,) = transitions.dispatch(session, [ti_id])
        assert queued.try_number == 1  # queued again at the try it had: no try counted
        assert transitions.start_many(session, [(ti_id, 1)], "host", "worker-2")
    assert _ti(sessions, ti_id).try_number == 1


def test_an_entry_lost_in_one_queue_stream_kills_no_attempt_of_another_with_the_same_id(
    worker: WorkerService, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two queues' streams may hold entries of the same id (ids are unique per stream): the
    lease lost on one names its stream, and only that attempt's process is killed."""
    killed: list[int] = []
    monkeypatch.setattr(worker.pool, "kill", killed.append)
    monkeypatch.setattr(worker.pool, "pid_of", lambda ti_id: None)
    monkeypatch.setattr(worker_service, "write_lines", lambda *args: None)  # no such tasks
    for ti_id, stream in ((1, "q:{queue:a}"), (2, "q:{queue:b}")):
        delivery = Delivery(Entry(stream, "5-0", {}), 1)
        worker.running[ti_id] = Running(delivery, Attempt(ti_id, 1, worker.name), f"t{ti_id}")
    worker._lost([Lost("q:{queue:a}", "5-0", LeaseStatus.TAKEN)])
    assert killed == [1] and list(worker.running) == [2]


def test_entries_a_failed_start_left_are_started_with_those_taken_over(
    worker: WorkerService, sessions: sessionmaker[Session], broker: Broker
) -> None:
    """Back from an outage, the takeover runs before the step retries the start that failed:
    both batches start (the first was dropped, its entry held and renewed for ever)."""
    left = queued_task(sessions, task_id="left")
    taken = queued_task(sessions, task_id="taken", run_id="r2")
    broker.publish(
        worker.streams[0], queue_message(worker.cipher, left, 1, DAG_ID, "r1", "left", -1)
    )
    worker.unstarted = worker.consumer.poll(1, block_ms=None)  # as a failed start leaves them
    assert len(worker.unstarted) == 1
    _held_entry(worker, broker, taken, "dead-worker", STALE_IDLE_MS)
    _register_dead(sessions, "dead-worker")

    worker._take_over()

    assert (_ti(sessions, left).state, _ti(sessions, taken).state) == ("running", "running")
    assert worker.unstarted == []
    assert sorted(worker.running) == sorted([left, taken])


def _lost_answer(monkeypatch: pytest.MonkeyPatch) -> None:
    """The next start commits (autocommit), then its connection drops before the answer
    arrives, as when PostgreSQL stops at once (tests/e2e/test_postgres_faults.py lost a task
    this way); the start after it is the real one."""
    real = transitions.start_many

    def committed_then_lost(session: Session, *args: object, **kwargs: object) -> list:
        real(session, *args, **kwargs)  # type: ignore[arg-type]
        monkeypatch.setattr(transitions, "start_many", real)
        raise OperationalError("start", {}, Exception("server closed the connection"))

    monkeypatch.setattr(transitions, "start_many", committed_then_lost)


def _submitted(worker: WorkerService, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    submitted: list[int] = []
    monkeypatch.setattr(worker.pool, "submit", lambda ti_id, request: submitted.append(ti_id))
    return submitted


def test_a_start_that_committed_though_its_answer_was_lost_is_run_by_the_retry(
    worker: WorkerService,
    sessions: sessionmaker[Session],
    broker: Broker,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The retry finds the task running on this worker at the entry's try: its own start,
    which nothing runs; it is run (skipped as "not queued", it stayed running until the
    reconciler failed it)."""
    ti_id = queued_task(sessions)
    broker.publish(worker.streams[0], queue_message(worker.cipher, ti_id, 1, DAG_ID, "r1", "t", -1))
    submitted = _submitted(worker, monkeypatch)
    _lost_answer(monkeypatch)
    with pytest.raises(OperationalError):
        worker._start(worker.consumer.poll(1, block_ms=None))
    assert _ti(sessions, ti_id).state == "running" and len(worker.unstarted) == 1

    worker._start(worker.unstarted)

    assert submitted == [ti_id] and list(worker.running) == [ti_id]
    assert worker.unstarted == []


@pytest.mark.parametrize("held_as", ["running", "unrecorded"])
def test_a_retried_start_does_not_run_again_what_this_worker_runs_or_ran(
    worker: WorkerService,
    sessions: sessionmaker[Session],
    broker: Broker,
    monkeypatch: pytest.MonkeyPatch,
    held_as: str,
) -> None:
    """A duplicate entry of an attempt this worker runs (or ran, its outcome not yet recorded),
    left by a failed start, is skipped: the attempt is this worker's, but not lost."""
    ti_id = queued_task(sessions)
    for _ in range(2):
        broker.publish(
            worker.streams[0], queue_message(worker.cipher, ti_id, 1, DAG_ID, "r1", "t", -1)
        )
    first, duplicate = worker.consumer.poll(2, block_ms=None)
    submitted = _submitted(worker, monkeypatch)
    worker._start([first])
    assert submitted == [ti_id]
    if held_as == "unrecorded":
        running = worker.running.pop(ti_id)
        worker.recorder.unrecorded = [(running, Failed("boom", "", allow_retry=True))]
        monkeypatch.setattr(worker.recorder, "record", lambda batch: None)
    worker.unstarted = [duplicate]  # as a failed start leaves it

    worker._start(worker.unstarted)

    assert submitted == [ti_id] and worker.unstarted == []


def test_a_retried_start_leaves_a_task_another_worker_runs(
    worker: WorkerService,
    sessions: sessionmaker[Session],
    broker: Broker,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    ti_id = running_task(sessions)  # running on WORKER, not this worker
    assert worker.name != WORKER
    broker.publish(worker.streams[0], queue_message(worker.cipher, ti_id, 1, DAG_ID, "r1", "t", -1))
    submitted = _submitted(worker, monkeypatch)
    worker.unstarted = worker.consumer.poll(1, block_ms=None)  # as a failed start leaves it

    worker._start(worker.unstarted)

    assert submitted == [] and _ti(sessions, ti_id).worker == WORKER
