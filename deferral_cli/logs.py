"""``deferral tasks logs``: what a try of a task wrote, and what was written about it."""

from __future__ import annotations

import time

import click
from sqlalchemy import select
from sqlalchemy.orm import Session

from broker.streams import task_label
from deferral.runtime.process import settings_or_exit, utc_timestamp
from deferral.store.tables import TaskInstance
from deferral.store.tasklogs import LogLine, read_lines, tries_with_logs, try_is_over
from deferral_cli.common import fail, find_run, run_id_argument, sessions

# How often --follow looks for new lines.
FOLLOW_POLL_SEC = 0.5
# The widest source ("triggerer"), so that the texts line up.
SOURCE_WIDTH = 9


@click.command("logs")
@click.argument("dag_id")
@run_id_argument
@click.argument("task_id")
@click.option(
    "--try",
    "try_number",
    type=click.IntRange(min=1),
    default=None,
    help="This try (default: the latest).",
)
@click.option("--map-index", type=int, default=-1, show_default=True, help="A mapped task's index.")
@click.option(
    "-f", "--follow", is_flag=True, help="Show new lines as they come, until the try ends."
)
def tasks_logs(
    dag_id: str, run_id: str, task_id: str, try_number: int | None, map_index: int, follow: bool
) -> None:
    """Show the log of TASK_ID's latest try in a run (or of --try N), in order: what the task
    wrote (stdout, stderr, logging; secrets masked), the worker's lines about its attempts and
    the triggerer's about its deferrals. Each line: time (UTC), source, text."""
    settings = settings_or_exit()
    factory = sessions(settings)
    label = task_label(dag_id, run_id, task_id, map_index)
    with factory() as session:
        ti = _task_instance(session, dag_id, run_id, task_id, map_index)
        if try_number is None:
            try_number = ti.try_number
        if not 1 <= try_number <= ti.try_number:
            fail(_no_such_try(session, ti, try_number, label))
    click.echo(f"# {label} try {try_number}")
    after = 0
    while True:
        with factory() as session:
            # The state first: lines committed with the end of the try are read after it.
            state, current_try = session.execute(
                select(TaskInstance.state, TaskInstance.try_number).where(TaskInstance.id == ti.id)
            ).one()
            lines = read_lines(session, ti.id, try_number, after_id=after)
        for line in lines:
            click.echo(_shown(line))
        after = lines[-1].id if lines else after
        if not follow:
            return
        if try_is_over(state, current_try, try_number):
            click.echo(f"# try {try_number} is over; the task is {state} at try {current_try}")
            return
        time.sleep(FOLLOW_POLL_SEC)


def _shown(line: LogLine) -> str:
    return f"{utc_timestamp(line.at.timestamp())} {line.source:<{SOURCE_WIDTH}} {line.text}"


def _task_instance(
    session: Session, dag_id: str, run_id: str, task_id: str, map_index: int
) -> TaskInstance:
    """The task instance named, or exit with one line saying which part names nothing."""
    if find_run(session, dag_id, run_id) is None:
        fail(f"DAG {dag_id!r} has no run {run_id!r}")
    indexes = {
        ti.map_index: ti
        for ti in session.scalars(
            select(TaskInstance).where(
                TaskInstance.dag_id == dag_id,
                TaskInstance.run_id == run_id,
                TaskInstance.task_id == task_id,
            )
        )
    }
    if not indexes:
        fail(f"run {run_id!r} of DAG {dag_id!r} has no task {task_id!r}")
    if map_index not in indexes:
        if map_index < 0:
            fail(f"task {task_id!r} is mapped: show one map index with --map-index N")
        fail(f"task {task_id!r} of run {run_id!r} has no map index {map_index}")
    return indexes[map_index]


def _no_such_try(session: Session, ti: TaskInstance, try_number: int, label: str) -> str:
    if ti.try_number == 0:
        return f"{label} has not started a try yet"
    logged = ", ".join(str(n) for n in tries_with_logs(session, ti.id)) or "none"
    return f"{label} has no try {try_number} (tries 1 to {ti.try_number}; with logs: {logged})"
