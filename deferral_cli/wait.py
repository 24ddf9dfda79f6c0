"""``dags trigger --wait``: follow a run to its end, showing each task's state as it changes.

On a terminal the run's tasks are one block of lines, redrawn in place as states change; to a
file or a pipe each change is one plain line. What is shown is decided by pure functions
(:func:`changes`, :func:`block`), so both forms are tested without a terminal.
"""

from __future__ import annotations

import datetime as dt
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TextIO

from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

from deferral.runtime.controls import escape_all
from deferral.states import FINISHED_STATES, DagRunState, TaskState
from deferral.store.actions import ti_label
from deferral.store.tables import DagRun, TaskInstance, TaskStateChange, Trigger
from deferral.triggers.composite import COMPOSITES
from deferral_cli.common import stamp
from readmodel import waits

FINISHED_RUN_STATES = frozenset({DagRunState.SUCCESS, DagRunState.FAILED})
POLL_INTERVAL_SEC = 0.5


# The waiting tasks of a run told how to resume, at most: each costs a look-up per poll.
MAX_HINTED = 10


@dataclass(frozen=True)
class TaskStatus:
    task: str  # task_id, with [map_index] for a mapped task's instance
    state: str
    try_number: int
    # For a task waiting on something a person or a machine sends (a signal, a callback, an
    # approval; never on a trigger that runs): what resumes it, with the command.
    resumed_by: str = ""


@dataclass(frozen=True)
class RunStatus:
    state: str | None  # None: the run is gone (deleted while waited on)
    tasks: tuple[TaskStatus, ...]  # in the order the scheduler created them


def read_status(session: Session, dag_id: str, run_id: str) -> RunStatus:
    """The run's state and its task instances', in one snapshot."""
    state = session.scalar(
        select(DagRun.state).where(DagRun.dag_id == dag_id, DagRun.run_id == run_id)
    )
    rows = session.execute(
        select(
            TaskInstance.id.label("ti_id"),
            TaskInstance.task_id,
            TaskInstance.map_index,
            TaskInstance.state,
            TaskInstance.try_number,
            Trigger.id.label("trigger_id"),
            Trigger.classpath,
        )
        .outerjoin(Trigger, Trigger.id == TaskInstance.trigger_id)
        .where(TaskInstance.dag_id == dag_id, TaskInstance.run_id == run_id)
        .order_by(TaskInstance.id)
    ).all()
    hints = _resumed_by(session, rows)
    tasks = tuple(
        TaskStatus(
            ti_label(row.task_id, row.map_index),
            row.state,
            row.try_number,
            hints.get(row.ti_id, ""),
        )
        for row in rows
    )
    return RunStatus(state, tasks)


def _resumed_by(session: Session, rows: Sequence[Any]) -> dict[int, str]:
    """What resumes each of the first MAX_HINTED tasks that wait on a send or an answer, by
    task instance id."""
    hints: dict[int, str] = {}
    waiting = [
        row
        for row in rows
        if row.state == TaskState.AWAITING_INPUT
        or (row.state == TaskState.DEFERRED and row.classpath is not None)
    ]
    for row in waiting[:MAX_HINTED]:
        if row.state == TaskState.AWAITING_INPUT:
            hints[row.ti_id] = (
                f"an answer: `deferral approvals respond {row.ti_id} <option>` (its question and"
                " options: `deferral approvals list`)"
            )
            continue
        held = row.classpath not in COMPOSITES or waits.is_held(session, row.trigger_id)
        wait = waits.row_wait_of(row.classpath, held)
        if wait is not None:
            key = waits.signal_key(session, row.trigger_id) if waits.needs_key(wait) else None
            hints[row.ti_id] = waits.how_to_resume(wait, key)
    return hints


def changes(before: RunStatus | None, after: RunStatus) -> list[str]:
    """One plain line per change from ``before`` to ``after``: the run's state, then each task
    whose state or try changed (every task, the first time); a finished run's state comes after
    its tasks', which finished before it."""
    tasks: list[str] = []
    seen = {} if before is None else {t.task: t for t in before.tasks}
    for task in after.tasks:
        if seen.get(task.task) != task:
            line = f"{task.task}: {task.state} (try {task.try_number})"
            tasks.append(f"{line}; resumed by {task.resumed_by}" if task.resumed_by else line)
    if before is not None and before.state == after.state:
        return tasks
    run = f"run: {after.state or 'gone'}"
    return [*tasks, run] if after.state in FINISHED_RUN_STATES else [run, *tasks]


def block(label: str, status: RunStatus, elapsed_sec: float, max_tasks: int = 1000) -> list[str]:
    """The lines a terminal shows: the run and how long it has been waited on, then each task
    in aligned columns. Past ``max_tasks`` tasks (the terminal's height), the unfinished ones
    are listed first and the rest counted by state on one line."""
    lines = [f"{label}: {status.state or 'gone'} ({elapsed_sec:.0f}s)"]
    tasks = list(status.tasks)
    rest: list[TaskStatus] = []
    if len(tasks) > max_tasks:
        # Stable sort: unfinished tasks first, each group in creation order.
        tasks.sort(key=lambda t: t.state in FINISHED_STATES)
        tasks, rest = tasks[: max(0, max_tasks - 1)], tasks[max(0, max_tasks - 1) :]
    width = max((len(t.task) for t in tasks), default=0)
    state_width = max((len(t.state) for t in tasks), default=0)
    # A hint goes below its task, in the lines the tasks leave of max_tasks: it never pushes a
    # task off the terminal.
    room = max_tasks - len(tasks)
    for t in tasks:
        lines.append(f"  {t.task.ljust(width)}  {t.state.ljust(state_width)}  try {t.try_number}")
        if t.resumed_by and room > 0:
            lines.append(f"    resumed by {t.resumed_by}")
            room -= 1
    if rest:
        counts = Counter(t.state for t in rest)
        lines.append(
            f"  and {len(rest)} more: "
            + ", ".join(f"{n} {state}" for state, n in sorted(counts.items()))
        )
    return lines


class Display(Protocol):
    def show(self, status: RunStatus, elapsed_sec: float) -> None: ...


class PlainLines:
    """A line per change, with the time of day (UTC) it was seen."""

    def __init__(self, out: TextIO, now: Callable[[], dt.datetime]) -> None:
        self.out, self.now = out, now
        self.last: RunStatus | None = None

    def show(self, status: RunStatus, elapsed_sec: float) -> None:
        at = stamp(self.now())
        for line in changes(self.last, status):
            self.out.write(f"{at} {line}\n")
        self.out.flush()
        self.last = status


class LiveBlock:
    """The block of :func:`block`, redrawn in place (ANSI: cursor up, erase line)."""

    def __init__(self, out: TextIO, label: str, height: int) -> None:
        self.out, self.label, self.drawn = out, label, 0
        # The cursor cannot go back above the screen's top: the block must fit on it.
        self.max_tasks = max(1, height - 3)

    def show(self, status: RunStatus, elapsed_sec: float) -> None:
        lines = [
            escape_all(line) for line in block(self.label, status, elapsed_sec, self.max_tasks)
        ]
        up = f"\x1b[{self.drawn}F" if self.drawn else ""
        # Erase what is left below when the block shrinks (a run that disappeared).
        self.out.write(up + "".join(f"\x1b[2K{line}\n" for line in lines) + "\x1b[J")
        self.out.flush()
        self.drawn = len(lines)


def wait_for_run(
    sessions: sessionmaker[Session],
    dag_id: str,
    run_id: str,
    timeout: float | None,
    display: Display | None = None,
    sleep: Callable[[float], None] = time.sleep,
) -> str | None:
    """Poll the run until it finishes; its final state, or None when ``timeout`` seconds passed
    first. ``display`` is shown every poll (it says only what changed)."""
    started = time.monotonic()
    while True:
        with sessions() as session:
            status = read_status(session, dag_id, run_id)
        elapsed = time.monotonic() - started
        if display is not None:
            display.show(status, elapsed)
        if status.state in FINISHED_RUN_STATES:
            return status.state
        if timeout is not None and elapsed > timeout:
            return None
        sleep(POLL_INTERVAL_SEC)


@dataclass(frozen=True)
class FailedTask:
    task: str
    error: str  # the first line of why it failed ("" if no reason was recorded)


MAX_FAILED_LISTED = 10


def failed_tasks(
    session: Session, dag_id: str, run_id: str, limit: int = MAX_FAILED_LISTED
) -> tuple[list[FailedTask], int]:
    """Up to ``limit`` failed task instances of the run, each with the reason of its latest move
    to failed, and how many failed in all."""
    ti = TaskInstance
    failed = (ti.dag_id == dag_id, ti.run_id == run_id, ti.state == TaskState.FAILED)
    total = session.scalar(select(func.count()).select_from(ti).where(*failed)) or 0
    reason = (
        select(TaskStateChange.reason)
        .where(
            TaskStateChange.task_instance_id == ti.id,
            TaskStateChange.to_state == TaskState.FAILED,
        )
        .order_by(TaskStateChange.id.desc())
        .limit(1)
        .scalar_subquery()
    )
    rows = session.execute(
        select(ti.task_id, ti.map_index, reason).where(*failed).order_by(ti.id).limit(limit)
    ).all()
    listed = [
        FailedTask(ti_label(task_id, map_index), _first_line(why or ""))
        for task_id, map_index, why in rows
    ]
    return listed, total


def failure_lines(listed: list[FailedTask], total: int) -> list[str]:
    """What a failed run's end says about its failed tasks."""
    lines = [f"failed: {t.task}" + (f": {t.error}" if t.error else "") for t in listed]
    if total > len(listed):
        lines.append(f"and {total - len(listed)} more failed task(s)")
    return lines


def _first_line(text: str) -> str:
    stripped = text.strip()
    return stripped.splitlines()[0] if stripped else ""
