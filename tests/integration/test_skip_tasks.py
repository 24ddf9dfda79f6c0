"""What a branch or short circuit chose against is skipped in the transaction of its success:
transitions.skip_tasks against real Postgres, and the worker's success path."""

from __future__ import annotations

import datetime as dt

from sqlalchemy import insert, select
from sqlalchemy.orm import Session, sessionmaker

from broker.consumer import Delivery
from broker.replies import Entry
from deferral.states import TaskState
from deferral.store import transitions
from deferral.store.tables import DagRun, TaskInstance, TaskStateChange
from deferral.store.transitions import Attempt, NewTaskInstance
from worker.outcomes import Succeeded
from worker.service import Running, WorkerService

TASKS = ["branch", "a", "b", "c", "done"]


def _run(sessions: sessionmaker[Session], run_id: str) -> dict[str, int]:
    """A run of TASKS, branch running, c scheduled, done succeeded; b has a second map index."""
    with sessions.begin() as session:
        transitions.create_dag_run(session, "d", run_id, dt.datetime.now(dt.UTC), {})
        run = session.scalars(select(DagRun).where(DagRun.run_id == run_id)).one()
        transitions.start_dag_run(
            session, run, [NewTaskInstance(t, 0, "default_pool", 1, "default", 1) for t in TASKS]
        )
        session.execute(
            insert(TaskInstance).values(
                dag_id="d",
                run_id=run_id,
                task_id="b",
                map_index=1,
                state=TaskState.NONE,
                pool="default_pool",
                pool_slots=1,
                queue="default",
                priority_weight=1,
            )
        )
        ids = {
            (ti.task_id, ti.map_index): ti.id
            for ti in session.scalars(select(TaskInstance).where(TaskInstance.run_id == run_id))
        }
        transitions.schedule(session, [ids[("branch", -1)], ids[("c", -1)], ids[("done", -1)]])
        transitions.dispatch(session, [ids[("branch", -1)], ids[("done", -1)]])
        transitions.start_many(
            session, [(ids[("branch", -1)], 1), (ids[("done", -1)], 1)], "h", "w"
        )
        transitions.succeed(session, Attempt(ids[("done", -1)], 1, "w"), None)
    return {f"{task}[{index}]": ti_id for (task, index), ti_id in ids.items()}


def _states(sessions: sessionmaker[Session], run_id: str) -> dict[str, str]:
    with sessions() as session:
        rows = session.scalars(select(TaskInstance).where(TaskInstance.run_id == run_id))
        return {f"{ti.task_id}[{ti.map_index}]": ti.state for ti in rows}


def test_skip_tasks_skips_waiting_instances_of_the_run_with_the_choosers_name(
    sessions: sessionmaker[Session],
) -> None:
    ids = _run(sessions, "r1")
    other = _run(sessions, "r2")
    with sessions.begin() as session:
        moved = transitions.skip_tasks(session, ids["branch[-1]"], ["b", "c", "done", "branch"])
    assert sorted(moved) == sorted([ids["b[-1]"], ids["b[1]"], ids["c[-1]"]])
    assert _states(sessions, "r1") == {
        "branch[-1]": "running",  # only none / scheduled move
        "a[-1]": "none",
        "b[-1]": "skipped",
        "b[1]": "skipped",  # every map index
        "c[-1]": "skipped",  # scheduled, not yet queued
        "done[-1]": "success",
    }
    assert set(_states(sessions, "r2").values()) - {"running", "success", "scheduled"} == {"none"}
    with sessions() as session:
        change = session.scalars(
            select(TaskStateChange)
            .where(TaskStateChange.task_instance_id == ids["c[-1]"])
            .order_by(TaskStateChange.id.desc())
        ).first()
    assert change is not None
    assert (change.from_state, change.to_state, change.reason) == (
        "scheduled",
        "skipped",
        "skipped by branch",
    )
    del other


def test_skip_tasks_with_nothing_to_skip_moves_nothing(sessions: sessionmaker[Session]) -> None:
    ids = _run(sessions, "r1")
    with sessions.begin() as session:
        assert transitions.skip_tasks(session, ids["branch[-1]"], []) == []
        assert transitions.skip_tasks(session, 999_999, ["a"]) == []
    assert _states(sessions, "r1")["a[-1]"] == "none"


def _running(worker: WorkerService, ti_id: int, entry_id: str) -> Running:
    """The branch task's attempt as the worker holds it (it runs on worker "w")."""
    delivery = Delivery(Entry(worker.streams[0], entry_id, {}), 1)
    return Running(delivery, Attempt(ti_id, 1, "w"), "d.branch")


def test_the_worker_skips_with_the_success_and_only_if_the_success_moved(
    worker: WorkerService, sessions: sessionmaker[Session]
) -> None:
    ids = _run(sessions, "r1")
    worker.recorder.record(
        [(_running(worker, ids["branch[-1]"], "0-1"), Succeeded("a", ("b", "c")))]
    )
    states = _states(sessions, "r1")
    assert (states["branch[-1]"], states["b[-1]"], states["c[-1]"]) == (
        "success",
        "skipped",
        "skipped",
    )
    assert states["a[-1]"] == "none"

    # A stale outcome (the branch task is no longer running) skips nothing.
    ids = _run(sessions, "r3")
    with sessions.begin() as session:
        attempt = Attempt(ids["branch[-1]"], 1, "w")
        transitions.fail(session, attempt, "worker died", allow_retry=False)
    worker.recorder.record([(_running(worker, ids["branch[-1]"], "0-2"), Succeeded("a", ("b",)))])
    states = _states(sessions, "r3")
    assert (states["branch[-1]"], states["b[-1]"]) == ("failed", "none")
