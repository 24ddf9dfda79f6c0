"""``deferral db prune`` removes old history and nothing a running run needs."""

from __future__ import annotations

import datetime as dt

from click.testing import CliRunner
from sqlalchemy import func, select, update
from sqlalchemy.orm import Session, sessionmaker

from deferral import tasklogs, transitions
from deferral.config import Settings
from deferral.models import (
    DagRun,
    Outbox,
    ResumeEvent,
    TaskInstance,
    TaskLog,
    TaskLogTry,
    TaskStateChange,
)
from deferral.states import DagRunState
from deferral.tasklogs import NewLine
from deferral.transitions import NewTaskInstance
from deferral_cli import main as deferral_main

LONG_AGO = dt.datetime.now(dt.UTC) - dt.timedelta(days=30)


def _run(sessions: sessionmaker[Session], run_id: str, *, finished: bool) -> int:
    """A run with one task that went none -> scheduled and wrote two log lines, and a resume
    event of its task."""
    with sessions.begin() as session:
        # One run per logical date (dag_run's unique key): a second apart per run.
        count = session.scalar(select(func.count()).select_from(DagRun)) or 0
        logical_date = LONG_AGO + dt.timedelta(seconds=count)
        transitions.create_dag_run(session, "d", run_id, logical_date, {})
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
        "pruned 1 outbox row(s), 2 resume event(s), 1 state change(s), 2 task log line(s)"
        " older than 7d"
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
    # Task instances and runs are never pruned.
    assert _count(sessions, TaskInstance) == 2 and _count(sessions, DagRun) == 2


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
