"""``worker consume``: reads task attempts from its queue stream and runs them in child processes.

The loop only moves messages and applies outcomes; each attempt runs in a reusable child process
(worker.attempt) so a crashing task cannot take the worker down, and every state change goes
through deferral.transitions so a duplicate or stale message never runs an attempt twice.
"""

from __future__ import annotations

import hashlib
import logging
import multiprocessing
import signal
import socket
import threading
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass

from sqlalchemy import select
from sqlalchemy.orm import Session

from broker import outbox
from broker.client import Broker, run_until_stopped
from broker.lease import Lease
from broker.replies import Entry
from broker.streams import (
    GROUP_WORKERS,
    MalformedEntry,
    QueueMessage,
    from_fields,
    trigger_message,
)
from deferral import serialization, transitions
from deferral.config import Settings
from deferral.crypto import Cipher, DecryptionError
from deferral.db import make_engine, make_sessionmaker
from deferral.models import DagRun, Outbox, TaskInstance
from deferral.process import Every, die_with_parent
from deferral.serialization import SerializationError
from worker.attempt import execute_attempt
from worker.outcomes import (
    AttemptRequest,
    Deferred,
    Failed,
    Outcome,
    Rescheduled,
    Skipped,
    Succeeded,
)

log = logging.getLogger("deferral.worker")


@dataclass(frozen=True)
class Running:
    entry: Entry
    task_instance_id: int
    label: str


def _init_child() -> None:
    """Children leave Ctrl-C to the worker, which lets running attempts finish before it exits,
    and die with their parent: a worker killed with -9 must not leave an attempt running that
    another worker will retry."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    die_with_parent()


def fingerprint(classpath: str, kwargs_json: bytes) -> str:
    return hashlib.sha256(classpath.encode() + b"\0" + kwargs_json).hexdigest()


class WorkerService:
    def __init__(self, settings: Settings, *, queue: str, concurrency: int, name: str) -> None:
        self.name = name
        self.hostname = socket.gethostname()
        self.concurrency = concurrency
        self.cipher = Cipher(settings.fernet_keys)
        self.sessions = make_sessionmaker(make_engine(settings.database_url))
        self.broker = Broker.from_url(settings.redis_url, settings.stream_prefix)
        self.stream = self.broker.keys.queue(queue)
        self.running: dict[Future[Outcome], Running] = {}
        self.pool = self._new_pool()
        self.lease = Lease.of(settings.heartbeat_sec)
        self.beat = Every(settings.heartbeat_sec, self._heartbeat)

    def _new_pool(self) -> ProcessPoolExecutor:
        context = multiprocessing.get_context("spawn")
        return ProcessPoolExecutor(
            max_workers=self.concurrency, mp_context=context, initializer=_init_child
        )

    def run(self, stop: threading.Event) -> None:
        self.broker.ensure_group(self.stream, GROUP_WORKERS)
        log.info("worker %s consuming %s with %d slots", self.name, self.stream, self.concurrency)
        run_until_stopped(self.broker, stop, self.step, self.stream, GROUP_WORKERS)
        log.info("stopping: waiting for %d running attempt(s)", len(self.running))
        while self.running:
            self.beat()  # the leases must outlive the attempts we wait for
            self._collect(timeout=0.5)
        self.pool.shutdown()
        self.broker.close()

    def step(self) -> None:
        self.beat()
        self._collect(timeout=0)
        free = self.concurrency - len(self.running)
        if free <= 0:
            self._collect(timeout=0.5)
            return
        # Block briefly when attempts are running, so finished ones are collected promptly.
        block_ms = 100 if self.running else 1000
        for entry in self.broker.read(
            GROUP_WORKERS, self.name, {self.stream: ">"}, count=free, block_ms=block_ms
        ):
            self._start(entry)

    # -- leases ----------------------------------------------------------------------------------

    def _heartbeat(self) -> None:
        """Renew the entries of running attempts; take over those of workers that stopped."""
        held = [running.entry.id for running in self.running.values()]
        lost = set(held) - set(self.broker.renew(self.stream, GROUP_WORKERS, self.name, held))
        for running in self.running.values():
            if running.entry.id in lost:
                # A peer decided we were dead and failed the attempt; our outcome will not apply.
                log.warning("lost the lease on %s to another worker", running.label)
        free = self.concurrency - len(self.running)
        if free > 0:
            for entry, owner in self.broker.claim_idle(
                self.stream,
                GROUP_WORKERS,
                self.name,
                min_idle_ms=self.lease.takeover_after_ms,
                count=free,
            ):
                self._start(entry, taken_from=owner)

    def _fail_orphan(
        self, entry: Entry, ti_id: int, try_number: int, label: str, dead_worker: str
    ) -> None:
        """The attempt of a worker that stopped heartbeating: fail it (retries apply), so it is
        never lost and never runs twice at once. Only if that worker is the one running it: the
        same try may since have been resumed from a deferral and be running on a live worker."""
        state = None
        with self.sessions.begin() as session:
            ti = session.get(TaskInstance, ti_id, with_for_update=True)
            if ti is not None and ti.worker == dead_worker:
                state = transitions.fail(
                    session,
                    ti_id,
                    f"worker {dead_worker} stopped heartbeating",
                    allow_retry=True,
                    try_number=try_number,
                )
        if state is not None:
            log.warning("%s: its worker %s stopped heartbeating; now %s", label, dead_worker, state)
        self.broker.ack_delete(self.stream, GROUP_WORKERS, [entry.id])

    # -- starting an attempt -------------------------------------------------------------------

    def _start(self, entry: Entry, *, taken_from: str | None = None) -> None:
        """Start the attempt an entry names; ``taken_from`` is the dead worker that held it."""
        if not entry.fields:
            return  # deleted while pending: nothing left to do
        try:
            message = from_fields(QueueMessage, entry.fields)
            ti_id, try_number = int(message.task_instance_id), int(message.try_number)
        except (MalformedEntry, ValueError) as exc:
            self._dead_letter(entry, f"bad queue entry: {exc}")
            return
        request: AttemptRequest | None = None
        with self.sessions.begin() as session:
            ti = transitions.start(session, ti_id, try_number, self.hostname, self.name)
            if ti is not None:
                request = self._request(session, ti)
        if ti is None and taken_from is not None:
            self._fail_orphan(entry, ti_id, try_number, message.task, taken_from)
            return
        if ti is None or request is None:
            if ti is None:
                log.info(
                    "skipping %s: not queued at try %d (duplicate or stale)",
                    message.task,
                    try_number,
                )
            self.broker.ack_delete(self.stream, GROUP_WORKERS, [entry.id])
            return
        try:
            future = self.pool.submit(execute_attempt, request)
        except BrokenProcessPool:
            self.pool = self._new_pool()
            future = self.pool.submit(execute_attempt, request)
        self.running[future] = Running(entry, ti_id, message.task)
        resuming = f" (resuming at {ti.next_method})" if ti.next_method else ""
        log.info("running %s try %d%s", message.task, try_number, resuming)

    def _request(self, session: Session, ti: TaskInstance) -> AttemptRequest | None:
        """Build the child's request; a task that cannot be run (its run is gone, its resume
        kwargs cannot be opened) fails here, with the reason, instead of blocking the queue."""
        run = session.scalars(
            select(DagRun).where(DagRun.dag_id == ti.dag_id, DagRun.run_id == ti.run_id)
        ).one_or_none()
        try:
            if run is None:
                raise LookupError(f"DAG run {ti.dag_id} {ti.run_id} no longer exists")
            next_kwargs = self.cipher.open(ti.next_kwargs) if ti.next_kwargs else None
        except (LookupError, DecryptionError, SerializationError) as exc:
            reason = f"cannot run: {exc}"
            transitions.fail(session, ti.id, reason, allow_retry=False)
            log.error("failed task instance %d: %s", ti.id, reason)
            return None
        assert ti.first_started_at is not None
        return AttemptRequest(
            task_instance_id=ti.id,
            dag_id=ti.dag_id,
            run_id=ti.run_id,
            task_id=ti.task_id,
            map_index=ti.map_index,
            try_number=ti.try_number,
            logical_date=run.logical_date,
            conf=dict(run.conf or {}),
            first_started_at=ti.first_started_at,
            next_method=ti.next_method,
            next_kwargs=next_kwargs,
        )

    # -- finishing an attempt ------------------------------------------------------------------

    def _collect(self, timeout: float) -> None:
        if not self.running:
            return
        done, _ = wait(list(self.running), timeout=timeout, return_when=FIRST_COMPLETED)
        for future in done:
            running = self.running.pop(future)
            try:
                outcome = future.result()
            except BrokenProcessPool as exc:
                # The child died (killed, segfault, os._exit): fail the attempt, not the worker.
                outcome = Failed(f"task process died: {exc}", "", allow_retry=True)
                self.pool = self._new_pool()
            except Exception as exc:
                outcome = Failed(f"task process error: {exc!r}", "", allow_retry=True)
            self._finish(running, outcome)

    def _finish(self, running: Running, outcome: Outcome) -> None:
        ti_id = running.task_instance_id
        staged: list[Outbox] = []
        with self.sessions.begin() as session:
            if isinstance(outcome, Succeeded):
                transitions.succeed(session, ti_id, outcome.return_value)
                log.info("%s succeeded", running.label)
            elif isinstance(outcome, Rescheduled):
                transitions.reschedule(session, ti_id, outcome.reschedule_date)
                log.info("%s pokes again at %s", running.label, outcome.reschedule_date)
            elif isinstance(outcome, Skipped):
                transitions.skip(session, ti_id, outcome.reason)
                log.info("%s skipped: %s", running.label, outcome.reason)
            elif isinstance(outcome, Failed):
                state = transitions.fail(
                    session, ti_id, outcome.error, allow_retry=outcome.allow_retry
                )
                log.error("%s %s: %s\n%s", running.label, state, outcome.error, outcome.traceback)
            else:
                staged = self._defer(session, ti_id, running.label, outcome)
        outbox.flush(self.sessions, self.broker, staged)
        self.broker.ack_delete(self.stream, GROUP_WORKERS, [running.entry.id])

    def _defer(self, session: Session, ti_id: int, label: str, outcome: Deferred) -> list[Outbox]:
        kwargs_json = serialization.encode(outcome.trigger_kwargs)
        trigger_id = transitions.create_trigger(
            session,
            outcome.classpath,
            self.cipher.encrypt(kwargs_json),
            fingerprint(outcome.classpath, kwargs_json),
        )
        moved = transitions.defer(
            session,
            ti_id,
            trigger_id=trigger_id,
            next_method=outcome.method_name,
            next_kwargs_token=self.cipher.encrypt(serialization.encode(outcome.next_kwargs)),
            trigger_timeout=outcome.trigger_timeout,
        )
        if not moved:
            session.rollback()
            log.warning("%s was no longer running; its deferral is dropped", label)
            return []
        message = trigger_message(
            self.cipher,
            trigger_id=trigger_id,
            classpath=outcome.classpath,
            kwargs=outcome.trigger_kwargs,
            task_instance_id=ti_id,
            task=label,
        )
        log.info("%s deferred to trigger %d (%s)", label, trigger_id, outcome.classpath)
        return [outbox.stage(session, self.broker.keys.triggers, message)]

    def _dead_letter(self, entry: Entry, error: str) -> None:
        log.error("dead-lettering %s entry %s: %s", entry.stream, entry.id, error)
        self.broker.dead_letter(entry, GROUP_WORKERS, error)
