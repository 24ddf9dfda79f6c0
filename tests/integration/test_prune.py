"""``deferral db prune`` removes old history and nothing a running run needs."""

from __future__ import annotations

import datetime as dt

from click.testing import CliRunner
from sqlalchemy import func, select, text, update
from sqlalchemy.orm import Session, sessionmaker

from deferral.runtime.config import Settings
from deferral.states import DagRunState
from deferral.store import retention, tasklogs, transitions, xcom
from deferral.store.tables import (
    DagRun,
    Outbox,
    RenderedTaskInstanceFields,
    ResumeEvent,
    Scheduler,
    TaskInstance,
    TaskLog,
    TaskLogTry,
    TaskReschedule,
    TaskStateChange,
    Triggerer,
    Worker,
    XCom,
)
from deferral.store.tasklogs import NewLine
from deferral.store.transitions import NewTaskInstance
from deferral_cli import main as deferral_main

LONG_AGO = dt.datetime.now(dt.UTC) - dt.timedelta(days=30)


def _run(
    sessions: sessionmaker[Session], run_id: str, *, finished: bool, run_type: str = "manual"
) -> int:
    """A run with one task that went none -> scheduled and wrote two log lines, and a resume
    event of its task."""
    with sessions.begin() as session:
        # One run per logical date (dag_run's unique key): a second apart per run.
        count = session.scalar(select(func.count()).select_from(DagRun)) or 0
        logical_date = LONG_AGO + dt.timedelta(seconds=count)
        transitions.create_dag_run(session, "d", run_id, logical_date, {}, run_type=run_type)
        run = session.scalars(select(DagRun).where(DagRun.run_id == run_id)).one()
        transitions.start_dag_run(
            session, run, [NewTaskInstance("t", 0, "default_pool", 1, "default", 1)]
        )
        session.flush()
        ti_id = session.scalars(select(TaskInstance.id).where(TaskInstance.run_id == run_id)).one()
        transitions.schedule(session, [ti_id])
        session.add(
            ResumeEvent(
                dedup_key=f"k-{run_id}", trigger_id=1, task_instance_id=ti_id, outcome="applied"
            )
        )
        lines = [NewLine(ti_id, 1, LONG_AGO, "task", text) for text in ("one", "two")]
        tasklogs.append(session, lines, max_bytes=1000)
        if finished:
            transitions.finish_dag_run(session, run, DagRunState.SUCCESS)
    with sessions.begin() as session:  # all of it happened a month ago
        session.execute(
            update(DagRun)
            .where(DagRun.run_id == run_id)
            .values(end_date=LONG_AGO if finished else None)
        )
        session.execute(update(ResumeEvent).values(received_at=LONG_AGO))
        session.execute(update(TaskStateChange).values(at=LONG_AGO))
    return ti_id


def _count(sessions: sessionmaker[Session], model: type, *where: object) -> int:
    with sessions() as session:
        return int(session.scalar(select(func.count()).select_from(model).where(*where)) or 0)


def test_prune_keeps_what_running_runs_need(
    settings: Settings, sessions: sessionmaker[Session]
) -> None:
    done = _run(sessions, "done", finished=True)
    running = _run(sessions, "running", finished=False)
    with sessions.begin() as session:
        session.add_all(
            [
                Outbox(stream="s", fields={}, created_at=LONG_AGO, published_at=LONG_AGO),
                Outbox(stream="s", fields={}, published_at=func.now()),  # recent
                Outbox(stream="s", fields={}, created_at=LONG_AGO),  # never published
                ResumeEvent(
                    dedup_key="dup", trigger_id=2, outcome="duplicate", received_at=LONG_AGO
                ),
            ]
        )

    result = CliRunner().invoke(deferral_main, ["db", "prune", "--older-than", "7d"])

    assert result.exit_code == 0, result.output
    assert result.output.strip() == (
        "pruned 1 outbox row(s), 2 resume event(s), 1 state change(s), 2 task log line(s),"
        " 1 run(s) with 1 task instance(s) and 0 XCom(s), 0 stopped process row(s),"
        " 0 history partition(s) dropped older than 7d"
    )
    # The finished run's history went; the running run's stayed.
    assert _count(sessions, TaskStateChange, TaskStateChange.task_instance_id == done) == 0
    assert _count(sessions, TaskStateChange, TaskStateChange.task_instance_id == running) == 1
    assert _count(sessions, TaskLog, TaskLog.task_instance_id == done) == 0
    assert _count(sessions, TaskLogTry, TaskLogTry.task_instance_id == done) == 0
    assert _count(sessions, TaskLog, TaskLog.task_instance_id == running) == 2
    assert _count(sessions, TaskLogTry, TaskLogTry.task_instance_id == running) == 1
    assert _count(sessions, ResumeEvent) == 1
    assert _count(sessions, ResumeEvent, ResumeEvent.task_instance_id == running) == 1
    # Unpublished and recent outbox rows stay.
    assert _count(sessions, Outbox) == 2
    assert _count(sessions, Outbox, Outbox.published_at.is_(None)) == 1
    # The finished run went with its task instance; the running run stayed.
    assert _count(sessions, TaskInstance) == 1
    assert _count(sessions, TaskInstance, TaskInstance.id == running) == 1
    assert [r.run_id for r in _runs(sessions)] == ["running"]


def _runs(sessions: sessionmaker[Session]) -> list[DagRun]:
    with sessions() as session:
        return list(session.scalars(select(DagRun).order_by(DagRun.logical_date)))


def _attach_history(sessions: sessionmaker[Session], ti_id: int) -> None:
    """An XCom, rendered fields and a reschedule of the task instance ``ti_id``."""
    with sessions.begin() as session:
        xcom.upsert(session, ti_id, "return_value", {"n": 1})
        session.add(RenderedTaskInstanceFields(task_instance_id=ti_id, try_number=1, rendered={}))
        session.add(
            TaskReschedule(
                task_instance_id=ti_id,
                try_number=1,
                start_date=LONG_AGO,
                end_date=LONG_AGO,
                reschedule_date=LONG_AGO,
            )
        )


def test_prune_removes_old_finished_runs_with_their_rows_but_what_runs_or_schedules(
    settings: Settings, sessions: sessionmaker[Session]
) -> None:
    old_manual = _run(sessions, "old-manual", finished=True)
    old_scheduled = _run(sessions, "old-scheduled", finished=True, run_type="scheduled")
    latest_scheduled = _run(sessions, "latest-scheduled", finished=True, run_type="scheduled")
    running = _run(sessions, "running", finished=False)
    for ti_id in (old_manual, old_scheduled, latest_scheduled, running):
        _attach_history(sessions, ti_id)
    recent = _run(sessions, "recent", finished=True)
    _attach_history(sessions, recent)
    with sessions.begin() as session:
        session.execute(update(DagRun).where(DagRun.run_id == "recent").values(end_date=func.now()))

    result = CliRunner().invoke(
        deferral_main, ["db", "prune", "--older-than", "7d", "--batch-size", "1"]
    )

    assert result.exit_code == 0, result.output
    # The latest scheduled run stays: the schedule's next run follows its data interval.
    assert [r.run_id for r in _runs(sessions)] == ["latest-scheduled", "running", "recent"]
    kept = [latest_scheduled, running, recent]
    for model in (TaskInstance, XCom, RenderedTaskInstanceFields, TaskReschedule):
        column = model.id if model is TaskInstance else model.task_instance_id
        with sessions() as session:
            left = sorted(session.scalars(select(column)))
        assert left == sorted(kept), model.__name__
    assert "2 run(s) with 2 task instance(s) and 2 XCom(s)" in result.output


def test_prune_removes_rows_of_processes_that_stopped_never_a_live_one(
    settings: Settings, sessions: sessionmaker[Session]
) -> None:
    long_ago = {"latest_heartbeat": LONG_AGO, "started_at": LONG_AGO}
    with sessions.begin() as session:
        for name, state in (("gone", "stopped"), ("killed", "running")):
            session.add(
                Worker(
                    name=name,
                    hostname="h",
                    pid=1,
                    queue="q",
                    concurrency=1,
                    state=state,
                    **long_ago,
                )
            )
            session.add(
                Triggerer(name=name, hostname="h", pid=1, capacity=1, state=state, **long_ago)
            )
            session.add(Scheduler(name=name, hostname="h", pid=1, state=state, **long_ago))
        session.add(
            Worker(name="live", hostname="h", pid=2, queue="q", concurrency=1, state="running")
        )
        session.add(Triggerer(name="live", hostname="h", pid=2, capacity=1, state="running"))
        session.add(Scheduler(name="live", hostname="h", pid=2, state="running"))
        # Stopped a minute ago: within any retention, and the floor keeps it even at 0s.
        session.add(
            Worker(
                name="just-stopped",
                hostname="h",
                pid=3,
                queue="q",
                concurrency=1,
                state="stopped",
                latest_heartbeat=func.now() - dt.timedelta(minutes=1),
            )
        )

    result = CliRunner().invoke(deferral_main, ["db", "prune", "--older-than", "0s"])

    assert result.exit_code == 0, result.output
    assert "6 stopped process row(s)" in result.output
    with sessions() as session:
        assert sorted(session.scalars(select(Worker.name))) == ["just-stopped", "live"]
        assert list(session.scalars(select(Triggerer.name))) == ["live"]
        assert list(session.scalars(select(Scheduler.name))) == ["live"]


def test_prune_in_small_batches_removes_everything_old(
    settings: Settings, sessions: sessionmaker[Session]
) -> None:
    with sessions.begin() as session:
        session.add_all(
            Outbox(stream="s", fields={}, created_at=LONG_AGO, published_at=LONG_AGO)
            for _ in range(25)
        )
    result = CliRunner().invoke(
        deferral_main, ["db", "prune", "--older-than", "1d", "--batch-size", "4"]
    )
    assert result.exit_code == 0
    assert _count(sessions, Outbox) == 0


def test_prune_refuses_a_bad_age_in_one_line(settings: Settings) -> None:
    result = CliRunner().invoke(deferral_main, ["db", "prune", "--older-than", "a week"])
    assert result.exit_code == 2
    assert "--older-than" in result.output and "is not a duration" in result.output


def test_each_batch_is_chosen_once_whatever_the_statistics_say(
    sessions: sessionmaker[Session],
) -> None:
    """Every prune statement picks its batch in a materialized CTE, run once: written as a
    ``WHERE id IN (SELECT … LIMIT)`` semi join, the task_instance statement was planned, with
    statistics saying the table is nearly empty, to run its subquery again for every row."""
    with sessions() as session:
        for table, statement in retention.STATEMENTS.items():
            sql = statement.format(partition=table)
            plan = "\n".join(
                session.scalars(
                    text(f"EXPLAIN {sql}"),
                    {"age": dt.timedelta(days=30), "batch": 10, "floor": retention.PROCESS_FLOOR},
                )
            )
            assert "CTE batch" in plan and "CTE Scan on batch" in plan, (table, plan)
