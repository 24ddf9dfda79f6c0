"""``deferral dags test`` and ``deferral tasks test``: one process runs a run's tasks, as Airflow's
``airflow dags test`` does, with no scheduler, worker or triggerer.

The run is recorded in Postgres like any other and goes through the same transitions: the
scheduler's evaluation (``scheduler.waiting.advance_run``: trigger rules, mapping, retries) picks
what may run, each attempt runs in this process as in a worker child (``worker.capture``: its
output stored in the try's log and shown here), its outcome is recorded as a worker records it
(``worker.record``), and a deferral's trigger runs in an in-process event loop
(``triggerer.events.first_event``) whose first event resumes the task at its method. Tasks run
one at a time, in dependency order (priority first among those ready). Nothing goes through
Redis: no service sees this run's work, so none may be running against the same database (a
scheduler would evaluate and dispatch the run too).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import logging
import os
import socket
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import anyio
import click
import msgspec
from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

from deferral.authoring.callbacks import REASON_SUCCESS, REASON_TASK_FAILURE, run_dag_callbacks
from deferral.context import DagRunInfo
from deferral.dag import DAG
from deferral.loading.dagbag import process_dagbag
from deferral.runtime import serialization
from deferral.runtime.config import Settings, is_configured
from deferral.runtime.crypto import Cipher
from deferral.runtime.process import settings_or_exit
from deferral.states import END_KINDS, FAIL_METHOD, DagRunState, TaskState
from deferral.store import actions, hitl, liveness, migrate, tasklogs, transitions
from deferral.store.tables import DagRun, Scheduler, TaskInstance, TaskStateChange
from deferral.store.tasklogs import SOURCE_WORKER, NewLine
from deferral.store.transitions import Attempt, FiredEvent
from deferral.triggers.task_end import check_end_xcoms
from deferral_cli import embedded as embedded
from deferral_cli.common import (
    EXIT_FAILED,
    DateTimeParam,
    TerminalSafe,
    fail,
    load_dag,
    sessions,
    stamp,
)
from scheduler import decide, runstate, waiting
from triggerer.decode import load_trigger_class
from triggerer.events import Outcome as TriggerOutcome
from triggerer.events import first_event, masked, raised_outcome
from worker import record
from worker.attempt import execute_attempt
from worker.capture import run_attempt_here
from worker.outcomes import (
    AttemptRequest,
    AwaitingInput,
    Deferred,
    Failed,
    Outcome,
    Rescheduled,
    Skipped,
    Succeeded,
)

TI = TaskInstance
# The run id of a run made for `tasks test` (deleted afterwards), before its logical date.
TEST_RUN_PREFIX = "tasks_test__"
# Longest sleep while only retries and reschedules are left, so a due one starts soon after.
WAIT_STEP_SEC = 1.0


class ServicesRunning(Exception):
    """A scheduler is alive on the database: it would run this run's tasks too."""


def refuse_if_services_run(sessions: sessionmaker[Session], settings: Settings) -> None:
    """Raise ServicesRunning naming a live scheduler of this database, if there is one."""
    with sessions() as session:
        now = session.execute(select(func.now())).scalar_one()
        for row in session.scalars(select(Scheduler)):
            if liveness.is_alive(row.state, row.latest_heartbeat, now, settings.heartbeat_sec):
                raise ServicesRunning(
                    f"scheduler {row.name} (on {row.hostname}) runs against this database: it"
                    " would run this run's tasks too; stop it, or use `deferral dags trigger"
                    " DAG --wait` to let the services run it"
                )


def terminal() -> TextIO | TerminalSafe:
    """A stream on this command's stdout that stays there while an attempt's output is
    captured (fds 1 and 2 then point elsewhere); what it writes is escaped, as every line the
    command prints is. Where stdout is no file (a test's runner), stdout itself."""
    try:
        fd = sys.stdout.fileno()
    except OSError:
        return sys.stdout
    return TerminalSafe(open(os.dup(fd), "w", buffering=1, encoding="utf-8"))


def run_row(session: Session, dag_id: str, run_id: str) -> DagRun:
    return session.scalars(
        select(DagRun).where(DagRun.dag_id == dag_id, DagRun.run_id == run_id)
    ).one()


def start_run(sessions: sessionmaker[Session], dag: DAG, run_id: str) -> None:
    """A queued run starts here, with its task instances, as the scheduler starts one."""
    with sessions.begin() as session:
        run = run_row(session, dag.dag_id, run_id)
        if run.state == DagRunState.QUEUED:
            tasks = [waiting.new_task_instance(run, task) for task in dag.tasks]
            transitions.start_dag_run(session, run, tasks)


@dataclass
class Shown:
    """What of the run has been shown: the last state change printed."""

    last_change: int = 0


class InThisProcess:
    """Runs tasks of one DAG run in this process, under a worker name of its own (every
    outcome is fenced on it, as a worker's are)."""

    kind = "dags-test"

    def __init__(
        self, settings: Settings, sessions: sessionmaker[Session], dag: DAG, run_id: str
    ) -> None:
        self.settings = settings
        self.sessions = sessions
        self.dag = dag
        self.run_id = run_id
        self.cipher = Cipher(settings.fernet_keys)
        self.hostname = socket.gethostname()
        self.name = f"{self.kind}-{self.hostname}-{os.getpid()}"


class LocalRun(InThisProcess):
    """Runs the tasks of one DAG run (already created, queued or running) in this process,
    saying what happens on ``out``."""

    out: TextIO | TerminalSafe
    shown: Shown

    # -- the run ---------------------------------------------------------------------------------

    def run(self, out: TextIO | TerminalSafe) -> DagRunState:
        """Run the run's tasks until it ends; returns its final state."""
        self.out, self.shown = out, Shown()
        self._start()
        while True:
            outcome, ready = self._evaluate()
            self._show_changes()
            if outcome is not None:
                return outcome
            if ready:
                self._run_attempt(*ready)
                continue
            self._wait_for_due()

    def _start(self) -> None:
        start_run(self.sessions, self.dag, self.run_id)

    def _run_row(self, session: Session) -> DagRun:
        return run_row(session, self.dag.dag_id, self.run_id)

    def _ids(self, session: Session, *states: TaskState) -> list[int]:
        return list(
            session.scalars(
                select(TI.id)
                .where(TI.dag_id == self.dag.dag_id, TI.run_id == self.run_id, TI.state.in_(states))
                .order_by(TI.priority_weight.desc(), TI.id)
            )
        )

    def _evaluate(self) -> tuple[DagRunState | None, tuple[int, int] | None]:
        """One evaluation, as the scheduler's: due retries and reschedules woken, waiting tasks
        decided, the run finished (and its DAG callbacks run) if nothing is left. Returns the
        run's outcome, or the (task instance, try) to run next, queued."""
        with self.sessions.begin() as session:
            run = self._run_row(session)
            due = self._ids(session, TaskState.UP_FOR_RETRY, TaskState.UP_FOR_RESCHEDULE)
            if due:
                transitions.wake_due(session, among=due)
            waiting.advance_run(session, run, self.dag, self.settings.max_map_length)
            unfinished, leaf_failed = runstate.outcome_probes(
                session, self.dag, run.dag_id, run.run_id
            )
            outcome = decide.run_outcome(unfinished=unfinished, leaf_failed=leaf_failed)
            if outcome is not None:
                transitions.finish_dag_run(session, run, outcome)
                ended = DagRunInfo.of(run)
            else:
                # Queued first: one this process queued and did not start (it was stopped).
                transitions.dispatch(session, self._ids(session, TaskState.SCHEDULED))
                queued = session.execute(
                    select(TI.id, TI.try_number)
                    .where(
                        TI.dag_id == self.dag.dag_id,
                        TI.run_id == self.run_id,
                        TI.state == TaskState.QUEUED,
                    )
                    .order_by(TI.priority_weight.desc(), TI.id)
                    .limit(1)
                ).one_or_none()
        if outcome is None:
            return None, None if queued is None else (queued.id, queued.try_number)
        # As the scheduler does once the run's end is committed (here, in this process).
        success = outcome == DagRunState.SUCCESS
        reason = REASON_SUCCESS if success else REASON_TASK_FAILURE
        run_dag_callbacks(self.dag, ended, success=success, reason=reason)
        return outcome, None

    def _wait_for_due(self) -> None:
        """Nothing can run now: sleep until the next retry or reschedule is due, or, while a
        task awaits input, until someone responds (`deferral approvals respond`, the web UI) or
        its response timeout passes (applied here, as a scheduler would)."""
        with self.sessions.begin() as session:
            if self._ids(session, TaskState.AWAITING_INPUT):
                hitl.expire(session, self.cipher)
                time.sleep(WAIT_STEP_SEC)
                return
        with self.sessions() as session:
            due_at, now = session.execute(
                select(func.min(TI.due_at), func.now()).where(
                    TI.dag_id == self.dag.dag_id, TI.run_id == self.run_id
                )
            ).one()
        if due_at is None:
            raise RuntimeError(
                f"run {self.run_id} of DAG {self.dag.dag_id} has unfinished tasks that nothing"
                " can move on (see `deferral tasks explain`)"
            )
        time.sleep(min(WAIT_STEP_SEC, max(0.0, (due_at - now).total_seconds())))

    # -- one attempt -----------------------------------------------------------------------------

    def _run_attempt(self, ti_id: int, try_number: int) -> None:
        with self.sessions.begin() as session:
            started = transitions.start_many(
                session,
                [(ti_id, try_number)],
                self.hostname,
                self.name,
                started_by=f"in `deferral dags test` ({self.hostname})",
            )
            if not started:
                return
            (ti,) = started
            next_kwargs = record.resume_kwargs(self.cipher, ti.next_kwargs, ti.next_event)
        self._show_changes()
        label = self._label(ti.task_id, ti.map_index)
        request = record.request_of(ti, next_kwargs, self.settings.task_log_max_bytes)
        outcome = run_attempt_here(request, echo=self._echo(label))
        attempt = Attempt(ti.id, ti.try_number, self.name)
        trigger_id = self._record(attempt, outcome)
        if isinstance(outcome, Deferred) and trigger_id is not None:
            self._show_changes()
            self._run_trigger(ti.id, trigger_id, outcome)

    def _record(self, attempt: Attempt, outcome: Outcome) -> int | None:
        """Record the outcome as a worker does; returns the trigger id of a deferral."""
        trigger_id = None
        with self.sessions.begin() as session:
            if isinstance(outcome, Succeeded):
                record.succeed_all(session, [(attempt, outcome)])
                said = "succeeded"
            elif isinstance(outcome, Deferred):
                deferral = record.deferral_of(attempt, outcome, self.cipher)
                trigger_id = transitions.defer_many(session, [deferral]).get(
                    attempt.task_instance_id
                )
                said = f"deferred to trigger {trigger_id} ({outcome.classpath})"
            else:
                _, said = record.apply_other(session, attempt, outcome)
                if isinstance(outcome, Failed) and outcome.traceback:
                    self.out.write(outcome.traceback.rstrip() + "\n")
            self._log(session, attempt.task_instance_id, attempt.try_number, said)
        return trigger_id

    def _run_trigger(self, ti_id: int, trigger_id: int, deferred: Deferred) -> None:
        """Run the trigger here until its first event (or its timeout), and resume the task
        with it, as the scheduler applies a triggerer's event."""
        fired = fire_inline(self.settings, self.cipher, self.name, trigger_id, deferred)
        with self.sessions.begin() as session:
            if fired is None:
                transitions.expire_deferrals(session, self.cipher, among=[ti_id])
            else:
                transitions.resume(session, fired, self.cipher)

    # -- what is shown -------------------------------------------------------------------------

    def _log(self, session: Session, ti_id: int, try_number: int, text: str) -> None:
        line = NewLine(ti_id, try_number, dt.datetime.now(dt.UTC), SOURCE_WORKER, text)
        tasklogs.append(session, [line], self.settings.task_log_max_bytes)

    @staticmethod
    def _label(task_id: str, map_index: int) -> str:
        return task_id if map_index < 0 else f"{task_id}[{map_index}]"

    def _echo(self, label: str) -> Callable[[Sequence[NewLine]], None]:
        def echo(lines: Sequence[NewLine]) -> None:
            for line in lines:
                self.out.write(f"{label} | {line.text}\n")

        return echo

    def _show_changes(self) -> None:
        """Print the run's task state changes not shown yet, with their reasons."""
        with self.sessions() as session:
            changes = session.execute(
                select(TaskStateChange, TI.task_id, TI.map_index)
                .join(TI, TI.id == TaskStateChange.task_instance_id)
                .where(
                    TI.dag_id == self.dag.dag_id,
                    TI.run_id == self.run_id,
                    TaskStateChange.id > self.shown.last_change,
                )
                .order_by(TaskStateChange.id)
            ).all()
        for change, task_id, map_index in changes:
            reason = f" ({change.reason})" if change.reason else ""
            at = stamp(change.at)
            label = self._label(task_id, map_index)
            self.out.write(f"[{at}] {label}: {change.from_state} -> {change.to_state}{reason}\n")
            self.shown.last_change = change.id


def fire_inline(
    settings: Settings, cipher: Cipher, name: str, trigger_id: int, deferred: Deferred
) -> FiredEvent | None:
    """Run a deferral's trigger in an event loop of this process to its first event (or
    failure), as a triggerer would (its payload masked as a triggerer masks it); None if the
    deferral's timeout passed first."""
    try:
        cls = load_trigger_class(deferred.classpath, settings.trigger_modules)
        trigger = cls(**serialization.from_jsonable(deferred.trigger_kwargs))
        trigger.trigger_id = trigger_id
    except Exception as exc:
        outcome = raised_outcome(cipher, name, trigger_id, "could not be built:", exc)
    else:
        left = None
        if deferred.trigger_timeout is not None:
            left = (deferred.trigger_timeout - dt.datetime.now(dt.UTC)).total_seconds()

        async def within_timeout() -> TriggerOutcome | None:
            with anyio.move_on_after(left):
                return await first_event(cipher, name, trigger, trigger_id, {})
            return None

        fired = anyio.run(within_timeout)
        if fired is None:
            return None
        outcome = fired
    outcome = masked(cipher, outcome, deferred.trigger_kwargs)
    payload = serialization.loads(outcome.payload)
    return FiredEvent(
        outcome.message.dedup_key,
        trigger_id,
        outcome.failure is not None,
        payload,
        ends=_ends(outcome.message.kind, payload),
    )


def _ends(kind: str, payload: Any) -> str | None:
    """The kind of a task-end event (end_from_trigger), which ends its task here too; None for
    another event, or one whose payload the scheduler would refuse (the task then resumes)."""
    if kind not in END_KINDS.values():
        return None
    try:
        check_end_xcoms(payload)
    except ValueError:
        return None
    return kind


# -- the commands ------------------------------------------------------------------------------


@contextmanager
def test_settings(subdir: Path | None, home: Path) -> Iterator[Settings]:
    """The settings to test with: the configured database, or with none configured an
    embedded PostgreSQL (and Redis, which settings require) under ``home``, as
    ``deferral standalone`` starts them, its schema brought up to date."""
    if subdir is not None:
        folder = subdir.resolve()
        os.environ["DEFERRAL_DAGS_FOLDER"] = str(folder if folder.is_dir() else folder.parent)
    if is_configured("DATABASE_URL"):
        yield settings_or_exit()
        return

    def say(message: str) -> None:
        click.echo(f"note: {message}", err=True)

    say(f"DEFERRAL_DATABASE_URL is not set: using an embedded PostgreSQL in {home}")
    with embedded.servers(home, say):
        settings = settings_or_exit()
        migrate.upgrade(settings.database_url)
        yield settings


_SUBDIR = click.option(
    "-S",
    "--subdir",
    type=click.Path(exists=True, path_type=Path),
    default=None,
    help="The DAGs folder, or a DAG file in it (default: DEFERRAL_DAGS_FOLDER).",
)
_HOME = click.option(
    "--home",
    type=click.Path(file_okay=False, path_type=Path),
    default=".deferral",
    show_default=True,
    help="Without DEFERRAL_DATABASE_URL: where the embedded servers' data and key are kept.",
)
_LOGICAL_DATE = click.argument("logical_date", required=False, type=DateTimeParam())


@click.command("test")
@click.argument("dag_id")
@_LOGICAL_DATE
@click.option("-c", "--conf", "conf_json", default=None, help="Run configuration, a JSON object.")
@_SUBDIR
@_HOME
def dags_test(
    dag_id: str,
    logical_date: dt.datetime | None,
    conf_json: str | None,
    subdir: Path | None,
    home: Path,
) -> None:
    """Run DAG_ID once, in this process, with no service running: its tasks in dependency
    order, deferrals included (their triggers run here), each task's state changes and log
    lines shown as they come. The run is recorded in the database (at LOGICAL_DATE, default
    now) like any other; with no DEFERRAL_DATABASE_URL, in an embedded PostgreSQL kept in HOME.
    Exit 0 if the run succeeded, 1 if it failed.
    """
    try:
        conf = actions.parse_conf(conf_json)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--conf") from None
    with test_settings(subdir, home) as settings:
        # Into the bag the task runs from (execute_attempt): its file is imported once.
        dag = load_dag(settings, dag_id, subdir, process_dagbag())
        made = sessions(settings)
        try:
            refuse_if_services_run(made, settings)
            run_id = actions.trigger_run(made, dag, conf, None, logical_date=logical_date).run_id
        except (ServicesRunning, actions.ActionError) as exc:
            fail(str(exc))
            return
        click.echo(f"testing {dag_id} {run_id}")
        state = LocalRun(settings, made, dag, run_id).run(terminal())
    click.echo(f"run {run_id}: {state}")
    sys.exit(0 if state == DagRunState.SUCCESS else EXIT_FAILED)


@click.command("test")
@click.argument("dag_id")
@click.argument("task_id")
@click.argument("when", metavar="[LOGICAL_DATE_OR_RUN_ID]", required=False)
@click.option(
    "--map-index",
    type=int,
    default=-1,
    help="Which map index of a mapped task (of a run where it has expanded).",
)
@_SUBDIR
@_HOME
def tasks_test(
    dag_id: str, task_id: str, when: str | None, map_index: int, subdir: Path | None, home: Path
) -> None:
    """Run TASK_ID once, in this process, ignoring its dependencies and recording no state,
    as Airflow's `tasks test`: in the run of DAG_ID at LOGICAL_DATE (or the run RUN_ID) if it
    exists (the task's XCom pulls read it; its pushes are written there, its state is left as
    it is), else in a run made for it and deleted afterwards. A deferral's trigger runs here and
    the task resumes with its event. Exit 0 if the task succeeded or skipped, 1 if it failed.
    """
    with test_settings(subdir, home) as settings:
        # Into the bag the task runs from (execute_attempt): its file is imported once.
        dag = load_dag(settings, dag_id, subdir, process_dagbag())
        if task_id not in dag.task_dict:
            fail(f"DAG {dag_id!r} has no task {task_id!r}")
        made = sessions(settings)
        run_id, made_for_test = _run_to_test_in(settings, made, dag, when)
        try:
            outcome = TaskTest(settings, made, dag, run_id).run(task_id, map_index)
        finally:
            if made_for_test:
                with made.begin() as session:
                    transitions.delete_dag_run(session, dag_id, run_id)
    label = LocalRun._label(task_id, map_index)
    if isinstance(outcome, Failed):
        if outcome.traceback:
            click.echo(outcome.traceback.rstrip(), err=True)
        click.echo(f"{label}: failed: {outcome.error}")
        sys.exit(EXIT_FAILED)
    said = {
        Succeeded: "success",
        Skipped: "skipped",
        Rescheduled: "would poke again later",
        AwaitingInput: "would await input (respond with `deferral approvals respond`)",
    }
    click.echo(f"{label}: {said[type(outcome)]}")


def _run_to_test_in(
    settings: Settings, made: sessionmaker[Session], dag: DAG, when: str | None
) -> tuple[str, bool]:
    """The run ``when`` names (a logical date or a run id) if it exists, else a new one
    (created and started here); and whether it was made for the test."""
    logical_date = None
    if when is not None:
        with contextlib.suppress(click.BadParameter):
            logical_date = DateTimeParam().convert(when, None, None)
    with made() as session:
        found = session.scalar(
            select(DagRun.run_id).where(
                DagRun.dag_id == dag.dag_id,
                DagRun.logical_date == logical_date
                if logical_date is not None
                else DagRun.run_id == when,
            )
        )
    if found is not None:
        return found, False
    if when is not None and logical_date is None:
        fail(f"{when!r} is neither a date nor a run of DAG {dag.dag_id!r}")
    logical_date = logical_date or dt.datetime.now(dt.UTC)
    try:
        refuse_if_services_run(made, settings)
        run_id = f"{TEST_RUN_PREFIX}{logical_date.isoformat()}"
        actions.trigger_run(made, dag, {}, run_id, logical_date=logical_date)
    except (ServicesRunning, actions.ActionError) as exc:
        fail(str(exc))
    start_run(made, dag, run_id)
    return run_id, True


class TaskTest(InThisProcess):
    """One task of a run, run here as a worker child runs an attempt, with none of its state
    recorded; a deferral's trigger runs here and the task resumes with its event."""

    kind = "tasks-test"

    def run(self, task_id: str, map_index: int) -> Outcome:
        self.task_id, self.map_index = task_id, map_index
        request = self._request()
        # Attempts log at INFO (as in a worker child); shown on stderr here.
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(tasklogs.LOG_FORMAT))
        root = logging.getLogger()
        root.addHandler(handler)
        saved_level = root.level
        root.setLevel(logging.INFO)
        try:
            while True:
                outcome = execute_attempt(request)
                if not isinstance(outcome, Deferred):
                    return outcome
                click.echo(
                    f"{self.task_id}: deferred to {outcome.classpath}; its trigger runs here"
                )
                request = self._resumed(request, outcome)
        finally:
            root.removeHandler(handler)
            root.setLevel(saved_level)

    def _request(self) -> AttemptRequest:
        """The attempt's request, as a worker would make it for the task instance, but as a
        first try that is no one's to retry (nothing of it is recorded)."""
        with self.sessions() as session:
            ti_id = session.scalar(
                select(TI.id).where(
                    TI.dag_id == self.dag.dag_id,
                    TI.run_id == self.run_id,
                    TI.task_id == self.task_id,
                    TI.map_index == self.map_index,
                )
            )
            started = None if ti_id is None else transitions.preview_start(session, ti_id)
        if started is None:
            fail(
                f"run {self.run_id!r} has no task instance {self.task_id!r}"
                f" at map index {self.map_index}"
            )
        assert started is not None
        request = record.request_of(started, None, self.settings.task_log_max_bytes)
        return msgspec.structs.replace(
            request,
            try_number=max(started.try_number, 1),
            first_started_at=dt.datetime.now(dt.UTC),
            next_method=None,
            max_tries=0,
        )

    def _resumed(self, request: AttemptRequest, deferred: Deferred) -> AttemptRequest:
        """The request that resumes the task with its trigger's event (no trigger row: the
        trigger is known here by the number 0)."""
        fired = fire_inline(self.settings, self.cipher, self.name, 0, deferred)
        if fired is None:
            method, kwargs = FAIL_METHOD, dict(transitions.TIMED_OUT_KWARGS)
        else:
            deferred_kwargs = serialization.from_jsonable(deferred.next_kwargs)
            resumed_at, kwargs = transitions.resume_point(
                fired, deferred.method_name, deferred_kwargs
            )
            method = resumed_at or deferred.method_name
        # In to_jsonable form, as a worker sends it: the attempt restores the values.
        jsonable = serialization.to_jsonable(kwargs, "resume kwargs")
        return msgspec.structs.replace(request, next_method=method, next_kwargs=jsonable)
