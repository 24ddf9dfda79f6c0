"""A task that finishes while the scheduler evaluates its (already marked) run must leave the run
marked: the scheduler read the tasks before that commit, and its clear must not erase the change."""

from __future__ import annotations

import threading

from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from deferral.store import transitions
from deferral.store.tables import DagRun, TaskInstance
from deferral.store.transitions import Attempt
from tests.integration.factories import WORKER, running_task


def test_finish_during_evaluation_keeps_the_run_marked(sessions: sessionmaker[Session]) -> None:
    ti_id = running_task(sessions, task_id="a", run_id="r1")
    with sessions() as session:
        ti = session.get(TaskInstance, ti_id)
        assert ti is not None
        run_pk = session.scalars(
            select(DagRun.id).where(DagRun.dag_id == ti.dag_id, DagRun.run_id == ti.run_id)
        ).one()
    with sessions.begin() as session:
        transitions.mark_runs(session, [run_pk])

    finished = threading.Event()

    def finish() -> None:
        with sessions.begin() as session:
            transitions.succeed_many(session, [(Attempt(ti_id, 1, WORKER), None)])
        finished.set()

    # The scheduler's side: lock the marked run and read its tasks, as evaluate_marked_runs does.
    with sessions.begin() as scheduler:
        run = scheduler.scalars(
            select(DagRun).where(DagRun.id == run_pk).with_for_update(skip_locked=True)
        ).one()
        states = scheduler.scalars(select(TaskInstance.state).where(TaskInstance.id == ti_id)).all()
        assert states == ["running"]
        worker = threading.Thread(target=finish)
        worker.start()
        # The finishing statement waits for the scheduler's lock rather than skipping the run.
        assert not finished.wait(1.0)
        transitions.evaluated(scheduler, run)
    worker.join(timeout=30)
    assert finished.is_set()

    with sessions() as session:
        run_after = session.get(DagRun, run_pk)
        assert run_after is not None
        assert run_after.evaluate_after is not None, "the success landed unseen by the scheduler"
