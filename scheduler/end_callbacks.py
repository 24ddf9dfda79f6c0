"""The callbacks of tasks a trigger ended (end_from_trigger): no worker runs such a task's last
step, so the scheduler calls its ``on_success_callback`` / ``on_failure_callback`` /
``on_retry_callback`` / ``on_skipped_callback`` after the end committed, off its loop, in the
pool where it calls DAG callbacks (a callback that raises is logged and changes nothing)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Executor

from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from deferral.authoring.callbacks import run_callbacks
from deferral.context import DagRunInfo, RuntimeTaskInstance, build_context
from deferral.dag import DAG
from deferral.states import TaskState
from deferral.store.tables import DagRun, TaskInstance
from deferral.store.xcom import DatabaseXComs

_CALLBACK_OF = {
    TaskState.SUCCESS: "on_success_callback",
    TaskState.FAILED: "on_failure_callback",
    TaskState.UP_FOR_RETRY: "on_retry_callback",
    TaskState.SKIPPED: "on_skipped_callback",
}


def call_back_ended(
    sessions: sessionmaker[Session],
    executor: Executor,
    dag_of: Callable[[str], DAG | None],
    ti_ids: Sequence[int],
) -> int:
    """Submit the callback of each task instance of ``ti_ids`` (ended by a trigger) for the
    state it ended in; returns how many were submitted."""
    if not ti_ids:
        return 0
    with sessions() as session:
        rows = session.execute(
            select(TaskInstance, DagRun)
            .join(
                DagRun,
                (DagRun.dag_id == TaskInstance.dag_id) & (DagRun.run_id == TaskInstance.run_id),
            )
            .where(TaskInstance.id.in_(ti_ids))
        ).all()
        session.expunge_all()
    submitted = 0
    xcoms = DatabaseXComs(sessions)
    for ti, run in rows:
        dag = dag_of(ti.dag_id)
        task = None if dag is None else dag.task_dict.get(ti.task_id)
        name = _CALLBACK_OF.get(TaskState(ti.state))
        callback = None if task is None or name is None else getattr(task, name, None)
        if task is None or callback is None:
            continue
        runtime = RuntimeTaskInstance(
            ti.id,
            ti.dag_id,
            ti.run_id,
            ti.task_id,
            ti.map_index,
            ti.try_number,
            xcoms,
            ti.first_started_at or ti.updated_at,
        )
        context = build_context(task, DagRunInfo.of(run), runtime)
        what = f"task {ti.task_id!r} {name}"
        executor.submit(run_callbacks, callback, context, what=what)
        submitted += 1
    return submitted
