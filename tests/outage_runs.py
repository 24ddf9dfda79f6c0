"""Runs of deferring tasks put through a server outage, and what must hold after: shared by the
e2e tests and ``benchmarks/postgres_faults.py``.

Each task of :data:`OUTAGE_DAG` defers for a few seconds and, resumed, appends one line to a
file of its own: that side effect, and ``task_state_change``, count how often it succeeded.
"""

from __future__ import annotations

import datetime as dt
from pathlib import Path

from sqlalchemy import func, select, text
from sqlalchemy.orm import Session, sessionmaker

from deferral.store.tables import DagRun, TaskInstance, TaskStateChange

OUTAGE_DAG = """
import datetime as dt
import pathlib

from deferral import DAG, BaseOperator
from deferral.triggers import TimeDeltaTrigger

OUT = pathlib.Path({out!r})


class WaitThenMark(BaseOperator):
    def execute(self, context):
        self.defer(
            trigger=TimeDeltaTrigger(dt.timedelta(seconds={seconds})), method_name="resume"
        )

    def resume(self, context, event):
        with (OUT / f"{dag_id}.{{context['run_id']}}.{{self.task_id}}").open("a") as mark:
            mark.write("done\\n")
        return "done"


with DAG("{dag_id}", max_active_runs=1000, max_active_tasks=1000) as dag:
    for i in range({n}):
        WaitThenMark(task_id=f"t{{i}}", retries=3, retry_delay=dt.timedelta(0))
"""


def outage_dag(dag_id: str, n: int, out: Path, seconds: float) -> str:
    """The source of ``dag_id``: ``n`` tasks deferring ``seconds``, marking files in ``out``."""
    return OUTAGE_DAG.format(dag_id=dag_id, n=n, out=str(out), seconds=seconds)


def reached(sessions: sessionmaker[Session], state: str, dag_id: str) -> int:
    """How many of ``dag_id``'s task instances have been in ``state`` at some point."""
    with sessions() as session:
        return int(
            session.scalar(
                select(func.count(func.distinct(TaskStateChange.task_instance_id)))
                .join(TaskInstance, TaskInstance.id == TaskStateChange.task_instance_id)
                .where(TaskInstance.dag_id == dag_id, TaskStateChange.to_state == state)
            )
            or 0
        )


def run_finished(sessions: sessionmaker[Session], dag_id: str, run_id: str) -> bool:
    with sessions() as session:
        state = session.scalar(
            select(DagRun.state).where(DagRun.dag_id == dag_id, DagRun.run_id == run_id)
        )
    return state in ("success", "failed")


def problems(
    sessions: sessionmaker[Session], dag_id: str, run_id: str, n: int, out: Path
) -> list[str]:
    """What broke exactly-once for the run: a task not succeeded, or succeeded (by
    ``task_state_change``) or marked (by its own file) other than once; empty if nothing."""
    with sessions() as session:
        rows = session.execute(
            select(TaskInstance.task_id, TaskInstance.state, func.count(TaskStateChange.id))
            .outerjoin(
                TaskStateChange,
                (TaskStateChange.task_instance_id == TaskInstance.id)
                & (TaskStateChange.to_state == "success"),
            )
            .where(TaskInstance.dag_id == dag_id, TaskInstance.run_id == run_id)
            .group_by(TaskInstance.task_id, TaskInstance.state)
        ).all()
    found = []
    if len(rows) != n:
        found.append(f"{len(rows)} task instances, expected {n}")
    for task_id, state, successes in rows:
        mark = out / f"{dag_id}.{run_id}.{task_id}"
        marks = mark.read_text().count("done") if mark.exists() else 0
        if (state, successes, marks) != ("success", 1, 1):
            found.append(f"{task_id}: {state}, {successes} success change(s), {marks} mark(s)")
    return found


def database_now(sessions: sessionmaker[Session]) -> dt.datetime:
    with sessions() as session:
        return session.scalar(text("SELECT clock_timestamp()"))  # type: ignore[no-any-return]


def first_change_after(
    sessions: sessionmaker[Session], dag_id: str, moment: dt.datetime
) -> dt.datetime | None:
    """When the first state change of ``dag_id``'s tasks after ``moment`` was recorded: work
    resumed then."""
    with sessions() as session:
        return session.scalar(
            select(func.min(TaskStateChange.at))
            .join(TaskInstance, TaskInstance.id == TaskStateChange.task_instance_id)
            .where(TaskInstance.dag_id == dag_id, TaskStateChange.at > moment)
        )
