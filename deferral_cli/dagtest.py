"""``deferral dags test`` and ``deferral tasks test``: one command runs a run's tasks, as Airflow's
``airflow dags test`` does, with no scheduler, worker or triggerer.

The run is recorded in Postgres like any other and goes through the same transitions: the
scheduler's evaluation (``scheduler.waiting.advance_run``: trigger rules, mapping, retries) picks
what may run, each attempt runs in a task process of the command's own as in a worker
(``worker.children``, ``worker.capture``: its output stored in the try's log and shown here),
its outcome is recorded as a worker records it (``worker.record``), and the triggers of deferred
tasks run in one event loop of this process (``triggerer.events.first_event``) whose first events
resume the tasks at their methods. What is ready runs at once: up to ``--concurrency`` attempts
(priority first), every trigger. A wait kept as a row (a signal, a callback, a request for input)
is answered by another process, and the command says how. Nothing goes through Redis: no service
sees this run's work, so none may be running against the same database (a scheduler would
evaluate and dispatch the run too).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import datetime as dt
import functools
import getpass
import logging
import os
import queue
import select as io_select
import shlex
import signal
import socket
import sys
import threading
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

from deferral import signals
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
from deferral.store import waits as row_waits
from deferral.store.assets import record_assets
from deferral.store.serialized_dags import stored_params
from deferral.store.tables import DagRun, Scheduler, TaskInstance, TaskStateChange
from deferral.store.tasklogs import SOURCE_WORKER, NewLine
from deferral.store.transitions import Attempt, FiredEvent
from deferral.triggers.asset_event import ASSET_TRIGGER
from deferral.triggers.signal import CALLBACK_TRIGGER, SIGNAL_TRIGGER
from deferral.triggers.task_end import check_end_xcoms
from deferral_cli import embedded as embedded
from deferral_cli.common import (
    EXIT_FAILED,
    DateTimeParam,
    fail,
    load_dag,
    run_conf,
    sessions,
    stamp,
)
from deferral_cli.group import TerminalSafe
from scheduler import assets, decide, runstate, waiting
from triggerer.decode import load_trigger_class
from triggerer.events import first_event, masked, raised_outcome
from worker import record
from worker.attempt import execute_attempt, warm_up
from worker.capture import attempt_runner
from worker.children import ChildDied, ChildPool
from worker.outcomes import (
    AttemptRequest,
    AwaitingInput,
    Deferred,
    Failed,
    Outcome,
    Rescheduled,
    Skipped,
    Succeeded,
    decode_outcome,
    encode,
)

TI = TaskInstance
# The run id of a run made for `tasks test` (deleted afterwards), before its logical date.
TEST_RUN_PREFIX = "tasks_test__"
# Task attempts run at once by default: a worker's slots (`worker --concurrency`).
DEFAULT_CONCURRENCY = 16
# How long the run waits for an attempt's end or a trigger's event before looking again.
POLL_SEC = 0.1
# How often the run is evaluated when nothing this process did changed it: a signal or a
# response from another process, a retry or poke that came due, a timeout that passed.
EVALUATE_EVERY_SEC = 0.5
STOP_TIMEOUT_SEC = 5.0
# How often a question asked in the terminal looks whether it is still wanted.
PROMPT_POLL_SEC = 0.2
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


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
            tasks = [
                waiting.new_task_instance(run, task)
                for task in decide.tasks_of_run(dag, run.run_type, run.logical_date)
            ]
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
    saying what happens on ``out``: the attempts whose turn it is at once, up to
    ``concurrency``, each in a task process of ``tasks``; the triggers of deferred tasks at once,
    in an event loop of this process; waits kept as rows (signals, callbacks, requests for
    input) until another process answers them, saying once each how."""

    out: TextIO | TerminalSafe
    shown: Shown
    triggers: TriggerLoop

    def __init__(
        self,
        settings: Settings,
        sessions: sessionmaker[Session],
        dag: DAG,
        run_id: str,
        tasks: ChildPool[int],
        concurrency: int,
        answering: Answering,
    ) -> None:
        super().__init__(settings, sessions, dag, run_id)
        self.tasks = tasks
        self.concurrency = concurrency
        self.answering = answering
        self.running: dict[int, Attempt] = {}
        self.labels: dict[int, str] = {}

    # -- the run ---------------------------------------------------------------------------------

    def run(self, out: TextIO | TerminalSafe) -> DagRunState:
        """Run the run's tasks until it ends; returns its final state."""
        self.out, self.shown = out, Shown()
        self._start()
        with TriggerLoop(self.settings, self.cipher, self.name) as self.triggers:
            evaluate_at = 0.0
            while True:
                if time.monotonic() >= evaluate_at:
                    outcome, queued = self._evaluate()
                    self._show_changes()
                    if outcome is not None:
                        return outcome
                    for ti_id, try_number in queued[: self.concurrency - len(self.running)]:
                        self._start_attempt(ti_id, try_number)
                    evaluate_at = time.monotonic() + EVALUATE_EVERY_SEC
                if self._collect():
                    evaluate_at = 0.0  # something ended here: what it unblocks runs now

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

    def _evaluate(self) -> tuple[DagRunState | None, list[tuple[int, int]]]:
        """One evaluation, as the scheduler's: due retries and reschedules woken, deferrals and
        requests for input past their timeouts ended, waiting tasks decided, the run finished
        (and its DAG callbacks run) if nothing is left. Returns the run's outcome, or the
        (task instance, try) of the queued attempts, highest priority first."""
        with self.sessions.begin() as session:
            run = self._run_row(session)
            due = self._ids(session, TaskState.UP_FOR_RETRY, TaskState.UP_FOR_RESCHEDULE)
            if due:
                transitions.wake_due(session, among=due)
            deferred = self._ids(session, TaskState.DEFERRED)
            if deferred:
                transitions.expire_deferrals(session, self.cipher, among=deferred)
                row_waits.fire_due_timers(session, self.cipher, among=deferred)
            if self._ids(session, TaskState.AWAITING_INPUT):
                hitl.expire(session, self.cipher)
            waiting.advance_run(session, run, self.dag, self.settings.max_map_length)
            unfinished, leaf_failed = runstate.outcome_probes(
                session, self.dag, run.dag_id, run.run_id
            )
            outcome = decide.run_outcome(unfinished=unfinished, leaf_failed=leaf_failed)
            if outcome is not None:
                transitions.finish_dag_run(session, run, outcome)
                ended = DagRunInfo.of(run)
            else:
                transitions.dispatch(session, self._ids(session, TaskState.SCHEDULED))
                queued = [
                    (row.id, row.try_number)
                    for row in session.execute(
                        select(TI.id, TI.try_number)
                        .where(
                            TI.dag_id == self.dag.dag_id,
                            TI.run_id == self.run_id,
                            TI.state == TaskState.QUEUED,
                        )
                        .order_by(TI.priority_weight.desc(), TI.id)
                    )
                ]
                waits = self._waits(session)
        if outcome is None:
            self.triggers.keep_only(waits.triggers)
            if not (queued or self.running or waits.any):
                raise RuntimeError(
                    f"run {self.run_id} of DAG {self.dag.dag_id} has unfinished tasks that"
                    " nothing can move on (see `deferral tasks explain`)"
                )
            return None, queued
        # As the scheduler does once the run's end is committed (here, in this process).
        success = outcome == DagRunState.SUCCESS
        reason = REASON_SUCCESS if success else REASON_TASK_FAILURE
        run_dag_callbacks(self.dag, ended, success=success, reason=reason)
        return outcome, []

    def _waits(self, session: Session) -> Waits:
        """What the run's unfinished tasks that cannot run now wait for."""
        deferred = select(TI.trigger_id).where(
            TI.dag_id == self.dag.dag_id,
            TI.run_id == self.run_id,
            TI.state == TaskState.DEFERRED,
            TI.trigger_id.is_not(None),
        )
        triggers = {trigger_id for trigger_id in session.scalars(deferred) if trigger_id}
        due_at = session.scalar(
            select(func.min(TI.due_at)).where(
                TI.dag_id == self.dag.dag_id, TI.run_id == self.run_id
            )
        )
        awaiting = bool(self._ids(session, TaskState.AWAITING_INPUT))
        return Waits(triggers, bool(triggers) or awaiting or due_at is not None)

    def _collect(self) -> bool:
        """Record the attempts that ended and apply the triggers' events that came, waiting a
        moment for one; whether there was any."""
        ended = self.tasks.collect(POLL_SEC) if self.running else []
        for ti_id, result in ended:
            attempt = self.running.pop(ti_id)
            outcome = (
                Failed(result.describe(), "", allow_retry=True)
                if isinstance(result, ChildDied)
                else decode_outcome(result)
            )
            self._record(attempt, outcome)
        fired = self.triggers.take(timeout=0 if ended or self.running else POLL_SEC)
        for event in fired:
            with self.sessions.begin() as session:
                transitions.resume(session, event, self.cipher)
        return bool(ended or fired)

    # -- one attempt -----------------------------------------------------------------------------

    def _start_attempt(self, ti_id: int, try_number: int) -> None:
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
        request = record.request_of(ti, next_kwargs, self.settings.task_log_max_bytes)
        self.running[ti.id] = Attempt(ti.id, ti.try_number, self.name)
        self.labels[ti.id] = self._label(ti.task_id, ti.map_index)
        self.tasks.submit(ti.id, encode(request))

    def _record(self, attempt: Attempt, outcome: Outcome) -> None:
        """Record the outcome as a worker does; start a deferral's trigger, or say how to
        answer what the task now waits for."""
        label = self.labels[attempt.task_instance_id]
        ti_id = attempt.task_instance_id
        answer: Callable[[], None] | None = None
        with self.sessions.begin() as session:
            if isinstance(outcome, Succeeded):
                record.succeed_all(session, self.cipher, [(attempt, outcome)])
                said = "succeeded"
            elif isinstance(outcome, Deferred):
                wait = record.wait_of(attempt, outcome)
                moved = signals.defer_with_waits(
                    session,
                    self.cipher,
                    [record.deferral_of(attempt, outcome, self.cipher)],
                    {} if wait is None else {ti_id: wait},
                )
                trigger_id = moved.get(ti_id)
                said = f"deferred to trigger {trigger_id} ({outcome.classpath})"
                if trigger_id is not None and (wait is None or not wait.holds):
                    self.triggers.start(trigger_id, outcome)
                if trigger_id is not None and wait is not None and wait.key:
                    answer = functools.partial(self._say_how_to_signal, label, wait.key, outcome)
            else:
                moved_other, said = record.apply_other(session, attempt, outcome)
                if isinstance(outcome, Failed) and outcome.traceback:
                    self.out.write(outcome.traceback.rstrip() + "\n")
                if isinstance(outcome, AwaitingInput) and moved_other:
                    answer = functools.partial(self._say_how_to_respond, label, ti_id, outcome)
            self._log(session, ti_id, attempt.try_number, said)
        self._show_changes()
        if answer is not None:
            answer()

    # -- what is shown -------------------------------------------------------------------------

    def _say_how_to_signal(self, label: str, key: str, deferred: Deferred) -> None:
        """Say once how another shell resumes a task waiting on a signal or a callback."""
        if deferred.classpath == CALLBACK_TRIGGER:
            self.out.write(
                f"# {label} waits for a POST of its answer to its callback URL"
                " (/api/v1/callbacks/<token>): a web server on this database takes it:\n"
            )
            self.out.write(self.answering.command("webserver") + "\n")
            return
        self.out.write(
            f"# {label} waits for a signal on {key!r}; send it from another shell"
            " (add --payload JSON to resume it with a value):\n"
        )
        self.out.write(self.answering.command("signals", "send", key) + "\n")

    def _say_how_to_respond(self, label: str, ti_id: int, asked: AwaitingInput) -> None:
        """Say once how another shell responds to a task awaiting input (and ask here too
        when this command reads a terminal)."""
        options = ", ".join(asked.options)
        self.out.write(
            f"# {label} awaits input: {asked.subject!r} (options: {options}); respond from"
            " another shell with one of them:\n"
        )
        example = asked.options[0] if asked.options else "OPTION"
        self.out.write(self.answering.command("approvals", "respond", str(ti_id), example) + "\n")
        if self.answering.prompter is not None:
            self.answering.prompter.ask(ti_id, label, list(asked.options), asked.multiple)

    def _log(self, session: Session, ti_id: int, try_number: int, text: str) -> None:
        line = NewLine(ti_id, try_number, dt.datetime.now(dt.UTC), SOURCE_WORKER, text)
        tasklogs.append(session, [line], self.settings.task_log_max_bytes)

    @staticmethod
    def _label(task_id: str, map_index: int) -> str:
        return task_id if map_index < 0 else f"{task_id}[{map_index}]"

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
        prompter = self.answering.prompter
        for change, task_id, map_index in changes:
            reason = f" ({change.reason})" if change.reason else ""
            at = stamp(change.at)
            label = self._label(task_id, map_index)
            if (
                prompter is not None
                and change.from_state == TaskState.AWAITING_INPUT
                and prompter.withdraw(change.task_instance_id)
            ):
                self.out.write("(answered from another shell)\n")
            self.out.write(f"[{at}] {label}: {change.from_state} -> {change.to_state}{reason}\n")
            self.shown.last_change = change.id


@dataclass(frozen=True)
class Waits:
    """What a run's tasks that cannot run now wait for: the triggers of its deferred tasks,
    and whether anything at all (a trigger, a signal, a response, a due retry or poke) will
    move one on."""

    triggers: set[int]
    any: bool


class Prompter:
    """Asks in this terminal for the responses of tasks awaiting input, one task at a time, on
    a thread of its own (the run goes on meanwhile); a response is recorded as `deferral
    approvals respond` records it, by the operating-system user.

    It reads the terminal's descriptor itself, waiting a poll at a time, rather than calling
    `input()`: with stdout not a terminal (`dags test | tee log`) `input()` blocks inside
    sys.stdin holding its lock, and the interpreter's exit then aborts ("Fatal Python error:
    could not acquire lock for <stdin>"). Polling also lets a question answered from another
    shell, or the command's end, stop it."""

    def __init__(
        self, sessions: sessionmaker[Session], cipher: Cipher, fd: int, out: TextIO | TerminalSafe
    ) -> None:
        self.sessions = sessions
        self.cipher = cipher
        self.fd = fd
        self.out = out
        self.asked: queue.SimpleQueue[tuple[int, str, list[str], bool]] = queue.SimpleQueue()
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.withdrawn: set[int] = set()
        self.showing: int | None = None  # the task whose question waits for a line typed
        self.thread = threading.Thread(target=self._ask_each, name="approvals", daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.stop.set()
        self.thread.join(STOP_TIMEOUT_SEC)

    def ask(self, ti_id: int, label: str, options: list[str], multiple: bool) -> None:
        self.asked.put((ti_id, label, options, multiple))

    def withdraw(self, ti_id: int) -> bool:
        """Ask no more for ``ti_id`` (it was answered, here or from another shell); whether its
        question is on screen waiting for a line, which the caller then ends."""
        with self.lock:
            self.withdrawn.add(ti_id)
            return self.showing == ti_id

    def _ask_each(self) -> None:
        while not self.stop.is_set():
            with contextlib.suppress(queue.Empty):
                asked = self.asked.get(timeout=PROMPT_POLL_SEC)
                while not self._asked_once(*asked):
                    pass

    def _asked_once(self, ti_id: int, label: str, options: list[str], multiple: bool) -> bool:
        """Ask once; whether the task needs no more asking (answered, here or elsewhere)."""
        several = "; several: a,b" if multiple else ""
        with self.lock:
            if ti_id in self.withdrawn:
                return True
            self.showing = ti_id
            self.out.write(f"{label}: respond here ({' / '.join(options)}{several}): ")
            self.out.flush()
        line = self._read_line(ti_id)
        with self.lock:
            self.showing = None
        if line is None:
            if self.stop.is_set():
                # Ended, so that what the command says next (`stopped by SIGINT`) starts a line.
                self.out.write("\n")
            return True
        chosen = [option.strip() for option in line.split(",") if option.strip()]
        if not chosen:
            return False
        try:
            with self.sessions.begin() as session:
                hitl.respond(session, self.cipher, ti_id, chosen, None, getpass.getuser())
        except hitl.NotAwaitingInput:
            return True
        except hitl.ResponseError as exc:
            self.out.write(f"{label}: {exc}\n")
            return False
        return True

    def _read_line(self, ti_id: int) -> str | None:
        """The next line typed; None at the end of input, once the command ends, or once
        ``ti_id`` is withdrawn."""
        typed = b""
        while not self.stop.is_set() and ti_id not in self.withdrawn:
            ready, _, _ = io_select.select([self.fd], [], [], PROMPT_POLL_SEC)
            if not ready:
                continue
            chunk = os.read(self.fd, 4096)
            if not chunk:
                return None
            typed += chunk
            if b"\n" in typed:
                return typed.split(b"\n", 1)[0].decode(errors="replace")
        return None


@contextmanager
def prompting(
    sessions: sessionmaker[Session], cipher: Cipher, out: TextIO | TerminalSafe
) -> Iterator[Prompter | None]:
    """A :class:`Prompter` on stdin when it is a terminal (else None), stopped at the end."""
    if sys.stdin is None or not sys.stdin.isatty():
        yield None
        return
    prompter = Prompter(sessions, cipher, sys.stdin.fileno(), out)
    try:
        yield prompter
    finally:
        prompter.close()


@dataclass(frozen=True)
class Answering:
    """How the lines saying how to answer a wait give another shell this run's database: the
    settings' ``NAME=value`` words (``embedded.command_prefix``); and the in-terminal prompt
    for requests for input, when this command reads a terminal."""

    prefix: str
    prompter: Prompter | None = None

    def command(self, *words: str) -> str:
        quoted = " ".join(shlex.quote(word) for word in ("deferral", *words))
        return f"{self.prefix} {quoted}" if self.prefix else quoted


class TriggerLoop:
    """The triggers of a run's deferred tasks, running at once in one event loop on a thread of
    this process, as a triggerer runs them; each one's first event (or failure) is handed over
    through :meth:`take`. A task's deferral timeout is the run's evaluation's
    (``transitions.expire_deferrals``), which then stops its trigger (:meth:`keep_only`)."""

    def __init__(self, settings: Settings, cipher: Cipher, name: str) -> None:
        self.settings = settings
        self.cipher = cipher
        self.name = name
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="triggers", daemon=True)
        self.running: dict[int, concurrent.futures.Future[None]] = {}
        self.fired: queue.SimpleQueue[FiredEvent] = queue.SimpleQueue()

    def __enter__(self) -> TriggerLoop:
        self.thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        """Cancel every trigger still running (their ``finally`` blocks run) and stop."""
        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(_cancel_all(), self.loop).result(STOP_TIMEOUT_SEC)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(STOP_TIMEOUT_SEC)
        if not self.thread.is_alive():
            self.loop.close()

    def start(self, trigger_id: int, deferred: Deferred) -> None:
        """Run trigger ``trigger_id`` (once, however many tasks share it)."""
        if trigger_id not in self.running:
            self.running[trigger_id] = asyncio.run_coroutine_threadsafe(
                self._fire(trigger_id, deferred), self.loop
            )

    async def _fire(self, trigger_id: int, deferred: Deferred) -> None:
        self.fired.put(await fire(self.settings, self.cipher, self.name, trigger_id, deferred))

    def keep_only(self, trigger_ids: set[int]) -> None:
        """Stop the triggers no task waits on any longer (their deferral timed out)."""
        for trigger_id in set(self.running) - trigger_ids:
            self.running.pop(trigger_id).cancel()

    def take(self, timeout: float) -> list[FiredEvent]:
        """The events fired since the last call, waiting up to ``timeout`` for the first."""
        taken: list[FiredEvent] = []
        with contextlib.suppress(queue.Empty):
            first = self.fired.get(timeout=timeout) if timeout > 0 else self.fired.get_nowait()
            taken.append(first)
            while True:
                taken.append(self.fired.get_nowait())
        return taken


async def _cancel_all() -> None:
    current = asyncio.current_task()
    tasks = [task for task in asyncio.all_tasks() if task is not current]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def fire(
    settings: Settings, cipher: Cipher, name: str, trigger_id: int, deferred: Deferred
) -> FiredEvent:
    """Run a deferral's trigger to its first event (or failure), as a triggerer would (its
    payload masked as a triggerer masks it)."""
    try:
        cls = load_trigger_class(deferred.classpath, settings.trigger_modules)
        trigger = cls(**serialization.from_jsonable(deferred.trigger_kwargs))
        trigger.trigger_id = trigger_id
    except Exception as exc:
        outcome = raised_outcome(cipher, name, trigger_id, "could not be built:", exc)
    else:
        outcome = await first_event(cipher, name, trigger, trigger_id, {})
    outcome = masked(cipher, outcome, deferred.trigger_kwargs)
    payload = serialization.loads(outcome.payload)
    return FiredEvent(
        outcome.message.dedup_key,
        trigger_id,
        outcome.failure is not None,
        payload,
        ends=_ends(outcome.message.kind, payload),
    )


def fire_inline(
    settings: Settings, cipher: Cipher, name: str, trigger_id: int, deferred: Deferred
) -> FiredEvent | None:
    """:func:`fire` in an event loop of its own, within the deferral's timeout; None if the
    timeout passed first."""
    left = None
    if deferred.trigger_timeout is not None:
        left = (deferred.trigger_timeout - dt.datetime.now(dt.UTC)).total_seconds()

    async def within_timeout() -> FiredEvent | None:
        with anyio.move_on_after(left):
            return await fire(settings, cipher, name, trigger_id, deferred)
        return None

    return anyio.run(within_timeout)


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
def test_settings(
    subdir: Path | None, home: Path, command: str
) -> Iterator[tuple[Settings, Path | None]]:
    """The settings to test with: the configured database, or with none configured an
    embedded PostgreSQL (and Redis, which settings require) under ``home``, as
    ``deferral standalone`` starts them, its schema brought up to date, ``home`` held for
    ``command`` meanwhile; and the file of the Fernet key, when it was filled in from one."""
    if subdir is not None:
        folder = subdir.resolve()
        os.environ["DEFERRAL_DAGS_FOLDER"] = str(folder if folder.is_dir() else folder.parent)
    if is_configured("DATABASE_URL"):
        yield settings_or_exit(), None
        return

    def say(message: str) -> None:
        click.echo(f"note: {message}", err=True)

    say(f"DEFERRAL_DATABASE_URL is not set: using an embedded PostgreSQL in {home}")
    with contextlib.ExitStack() as held:
        # Before any server starts: a standalone on this home has them running (a second Redis
        # would move its kept port, and its scheduler would run this run's tasks too).
        try:
            held.enter_context(embedded.holding_home(home, command))
        except embedded.HomeInUse as exc:
            fail(
                f"{exc} (a standalone's services run a DAG with `deferral dags trigger DAG_ID"
                " --wait` in a shell given its export lines)"
            )
        filled = held.enter_context(embedded.servers(home, say))
        settings = settings_or_exit()
        migrate.upgrade(settings.database_url)
        yield settings, filled.key_file


class Stopped(Exception):
    """SIGINT (Ctrl-C) or SIGTERM reached the command."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


@contextmanager
def stopped_by_signals() -> Iterator[None]:
    """SIGINT and SIGTERM raise Stopped in the main thread, once: the unwinding that follows
    (task processes, triggers and embedded servers stopped) is not interrupted by another."""
    stopped: list[int] = []

    def stop(signum: int, frame: object) -> None:
        for sig in STOP_SIGNALS:
            signal.signal(sig, signal.SIG_IGN)
        stopped.append(signum)
        raise Stopped(signum)

    previous = {sig: signal.signal(sig, stop) for sig in STOP_SIGNALS}
    try:
        yield
    finally:
        if not stopped:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


@contextmanager
def task_processes(out: TextIO | TerminalSafe) -> Iterator[ChildPool[int]]:
    """The task processes of ``dags test``: a worker's (``worker.children``), each attempt's
    output stored in its try's log and shown on ``out`` as it comes. Made before this process
    opens a database connection (the fork server copies the process) and with the stop
    signals ignored, which its processes keep: this process stops them."""
    label = LocalRun._label

    def echo(request: AttemptRequest, lines: Sequence[NewLine]) -> None:
        shown = label(request.task_id, request.map_index)
        out.write("".join(f"{shown} | {line.text}\n" for line in lines))

    saved = {sig: signal.signal(sig, signal.SIG_IGN) for sig in STOP_SIGNALS}
    try:
        pool: ChildPool[int] = ChildPool(attempt_runner(echo), warm_up)
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)
    try:
        yield pool
    finally:
        pool.shutdown()


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
@click.option(
    "--concurrency",
    type=click.IntRange(min=1),
    default=DEFAULT_CONCURRENCY,
    show_default=True,
    help="Task attempts run at once, each in a task process of its own (a worker's slots);"
    " deferred tasks' triggers all run at once whatever it is.",
)
@_SUBDIR
@_HOME
def dags_test(
    dag_id: str,
    logical_date: dt.datetime | None,
    conf_json: str | None,
    concurrency: int,
    subdir: Path | None,
    home: Path,
) -> None:
    """Run DAG_ID once, with no service running: the tasks whose upstreams are done run at
    once (up to --concurrency), deferrals included (their triggers run in this process), each
    task's state changes and log lines shown as they come. A task waiting on a signal, a
    callback or a response is said once, with the command that answers it from another shell.
    The run is recorded in the database (at LOGICAL_DATE, default now) like any other; with no
    DEFERRAL_DATABASE_URL, in an embedded PostgreSQL kept in HOME. Exit 0 if the run succeeded,
    1 if it failed, 130 on Ctrl-C and 143 on SIGTERM (the run is left as it is).
    """
    conf = run_conf(conf_json)
    started: list[str] = []
    try:
        with stopped_by_signals():
            state = _test_dag(dag_id, logical_date, conf, concurrency, subdir, home, started)
    except Stopped as stop:
        left = f"; run {started[0]} of DAG {dag_id} is left as it is" if started else ""
        click.echo(f"stopped by {stop}{left}", err=True)
        sys.exit(128 + stop.signum)
    click.echo(f"run {started[0]}: {state}")
    sys.exit(0 if state == DagRunState.SUCCESS else EXIT_FAILED)


def _test_dag(
    dag_id: str,
    logical_date: dt.datetime | None,
    conf: dict[str, Any],
    concurrency: int,
    subdir: Path | None,
    home: Path,
    started: list[str],
) -> DagRunState:
    """Run the test of ``dags test``, putting the run's id in ``started`` once it is made."""
    with test_settings(subdir, home, "dags test") as (settings, key_file):
        out = terminal()
        # Into the bag of this process, before its task processes are forked from it: they find
        # the DAG there and import nothing more (with --subdir FILE, no other file of its
        # folder is ever imported).
        bag = process_dagbag()
        dag = load_dag(settings, dag_id, subdir, bag)
        with task_processes(out) as tasks:
            # Started together, not one by one as the first attempts come.
            tasks.prestart(min(concurrency, len(dag.tasks)))
            made = sessions(settings)
            try:
                refuse_if_services_run(made, settings)
                # The assets of the DAGs read, as a scheduler's read records them: which of
                # two sharing a URI is active is decided here as there (Airflow's `dags test`
                # records its bag's too).
                with made.begin() as session:
                    record_assets(session, assets.named_assets(bag.dags))
                run = actions.trigger_run(made, dag, conf, None, logical_date=logical_date)
            except (ServicesRunning, actions.ActionError) as exc:
                fail(str(exc))
                raise  # unreachable: fail exits
            started.append(run.run_id)
            out.write(f"testing {dag_id} {run.run_id}\n")
            prefix, notes = embedded.command_prefix(os.environ, key_file)
            for note in notes:
                out.write(f"# to answer a wait from another shell: {note}\n")
            with prompting(made, Cipher(settings.fernet_keys), out) as prompter:
                local = LocalRun(
                    settings, made, dag, run.run_id, tasks, concurrency, Answering(prefix, prompter)
                )
                return local.run(out)


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
@click.option(
    "-t",
    "--task-params",
    "task_params_json",
    default=None,
    help="Params for this test, a JSON object: they replace the task's of the same names"
    " (checked against the DAG's params), as Airflow's --task-params.",
)
@_SUBDIR
@_HOME
def tasks_test(
    dag_id: str,
    task_id: str,
    when: str | None,
    map_index: int,
    task_params_json: str | None,
    subdir: Path | None,
    home: Path,
) -> None:
    """Run TASK_ID once, in this process, ignoring its dependencies and recording no state,
    as Airflow's `tasks test`: in the run of DAG_ID at LOGICAL_DATE (or the run RUN_ID) if it
    exists (the task's XCom pulls read it; its pushes are written there, its state is left as
    it is), else in a run made for it and deleted afterwards. A deferral's trigger runs here and
    the task resumes with its event. Exit 0 if the task succeeded or skipped, 1 if it failed.
    """
    try:
        task_params = actions.parse_conf(task_params_json)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--task-params") from None
    with test_settings(subdir, home, "tasks test") as (settings, _):
        # Into the bag the task runs from (execute_attempt): its file is imported once.
        dag = load_dag(settings, dag_id, subdir, process_dagbag())
        if task_id not in dag.task_dict:
            fail(f"DAG {dag_id!r} has no task {task_id!r}")
        if task_params:
            try:
                actions.check_conf(dag_id, stored_params(dag.params, dag.param_specs), task_params)
            except actions.ActionError as exc:
                raise click.BadParameter(str(exc), param_hint="--task-params") from None
            dag.task_dict[task_id].params.update(task_params)  # this process's copy only
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
                if outcome.classpath in (SIGNAL_TRIGGER, CALLBACK_TRIGGER, ASSET_TRIGGER):
                    # Answered through the task's recorded wait, which this test does not make.
                    fail(
                        f"{self.task_id} waits for a signal, a callback or an asset event,"
                        " which `tasks test` (recording no state) cannot receive; use"
                        " `deferral dags test`"
                    )
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
