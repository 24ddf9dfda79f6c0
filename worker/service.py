"""``worker consume``: reads task attempts from its queue stream and runs them in child processes.

The loop only moves messages and applies outcomes, a batch at a time: the entries read together
start in one statement, the attempts that ended together are recorded in one transaction and
their entries retired in one call. Each attempt runs in a reusable child process
(:mod:`worker.children`), and every outcome is fenced on (task instance, try, worker): a worker that
lost its lease kills that attempt's child and changes nothing in Postgres.
"""

from __future__ import annotations

import datetime as dt
import logging
import os
import socket
import threading
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from sqlalchemy import select, tuple_
from sqlalchemy.orm import Session

from broker import outbox
from broker.client import Broker, LeaseStatus, connect_when_up
from broker.consumer import Delivery, Lost, Quarantine, StreamConsumer, run_until_stopped
from broker.consumers import ConsumerSet
from broker.owners import PostgresOwners
from broker.streams import (
    GROUP_WORKERS,
    WAKE,
    ForgedEntry,
    MalformedEntry,
    QueuedAttempt,
    StreamKeys,
    read_queue_entry,
    task_label,
    trigger_message,
)
from deferral import signals
from deferral.runtime import metrics
from deferral.runtime.config import Settings, SmtpSettings
from deferral.runtime.crypto import Cipher, DecryptionError
from deferral.runtime.faults import is_transient
from deferral.runtime.process import (
    Every,
    LogExtra,
    freeze_startup_objects,
    log_ids,
    wait_ms_until_due,
)
from deferral.runtime.serialization import SerializationError
from deferral.states import TaskState
from deferral.store import liveness, tasklogs, transitions
from deferral.store.db import make_engine, make_sessionmaker, wait_until_up
from deferral.store.tables import TaskInstance, Worker
from deferral.store.tasklogs import SOURCE_WORKER, NewLine
from deferral.store.transitions import Attempt
from worker import record
from worker.attempt import warm_up
from worker.capture import run_attempt
from worker.children import ChildDied, ChildPool
from worker.mail import Mail, Mailer
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

log = logging.getLogger("deferral.worker")

TI = TaskInstance
# The longest a worker with no attempt running waits on Redis for entries.
IDLE_BLOCK_MS = 1000

# The deferral_task_attempts label of each outcome ("dropped": fenced out, see _say).
_OUTCOME_LABELS: dict[type, str] = {
    Succeeded: "success",
    Failed: "failed",
    Deferred: "deferred",
    Rescheduled: "rescheduled",
    Skipped: "skipped",
    AwaitingInput: "awaiting_input",
}


@dataclass(frozen=True)
class Running:
    delivery: Delivery
    attempt: Attempt
    label: str

    def log_ids(self) -> LogExtra:
        """``extra=`` for a log line about this attempt."""
        return log_ids(
            task=self.label,
            task_instance_id=self.attempt.task_instance_id,
            try_number=self.attempt.try_number,
        )

    def log_line(self, text: str) -> NewLine:
        """A line of the worker's about this attempt, for its try's log."""
        return _line(self.attempt.task_instance_id, self.attempt.try_number, text)


def _item_ids(item: QueuedAttempt) -> LogExtra:
    """``extra=`` for a log line about a queue entry's attempt."""
    return log_ids(
        task=item.task, task_instance_id=item.task_instance_id, try_number=item.try_number
    )


def _line(ti_id: int, try_number: int, text: str) -> NewLine:
    """A line of the worker's about an attempt, for its try's log."""
    return NewLine(ti_id, try_number, dt.datetime.now(dt.UTC), SOURCE_WORKER, text)


class WorkerService:
    def __init__(
        self,
        settings: Settings,
        *,
        queues: Sequence[str],
        concurrency: int,
        name: str,
        smtp: SmtpSettings | None = None,
    ) -> None:
        self.settings = settings
        self.name = name
        self.hostname = socket.gethostname()
        self.queues = tuple(queues)
        self.concurrency = concurrency
        self.cipher = Cipher(settings.fernet_keys)
        self.engine = make_engine(settings.database_url)
        self.sessions = make_sessionmaker(self.engine)
        self.keys = StreamKeys.for_redis(
            settings.stream_prefix, settings.redis_url, settings.stream_shards
        )
        self.streams = [self.keys.queue(queue) for queue in self.queues]
        # A deferred task's trigger goes to a triggers stream of the queue it ran from.
        self.queue_of = {self.keys.queue(q): q for q in self.queues}
        # Keyed by task instance id.
        self.pool: ChildPool[int] = ChildPool(
            run_attempt, warm_up, max_attempts=settings.worker_task_process_max_attempts
        )
        self.running: dict[int, Running] = {}
        # Work read or ended but not yet recorded because the servers failed: retried first.
        self.unstarted: list[Delivery] = []
        self.unrecorded: list[tuple[Running, Outcome]] = []
        # Outcomes of the batch being recorded, counted in the metrics once committed; and the
        # email alerts of its failures, sent once committed.
        self.tally: Counter[str] = Counter()
        self.mails: list[Mail] = []
        self.mailer = Mailer(smtp)
        self.broker: Broker
        self.consumer: ConsumerSet
        beat = settings.heartbeat_sec
        # Takeovers are looked for more often than leases are renewed: an entry is claimed soon
        # after it passes the takeover threshold, not up to a heartbeat later.
        self.periodic = [Every(beat, self._heartbeat), Every(beat / 4, self._take_over)]
        metrics.ATTEMPTS_RUNNING.set_function(lambda: len(self.running))
        metrics.WORKER_SLOTS_FREE.set_function(lambda: self.concurrency - len(self.running))

    # -- the loop --------------------------------------------------------------------------------

    def run(self, stop: threading.Event) -> None:
        broker = connect_when_up(
            self.settings.redis_url, self.settings.stream_prefix, stop, self.settings.stream_shards
        )
        if broker is None or not wait_until_up(self.engine, stop):
            return
        self.attach(broker)
        if not run_until_stopped(stop, self._begin, recover=self.consumer.start, once=True):
            return
        freeze_startup_objects()
        streams = ", ".join(self.streams)
        log.info("worker %s consuming %s with %d slots", self.name, streams, self.concurrency)
        run_until_stopped(stop, self.step, recover=self.consumer.start)
        log.info("stopping: waiting for %d running attempt(s)", len(self.running))
        drained = threading.Event()

        def drain() -> None:
            for periodic in self.periodic:
                periodic()  # the leases must outlive the attempts we wait for
            self._record_ended(timeout=0.5)
            if not self.running and not self.unrecorded:
                drained.set()

        run_until_stopped(drained, drain, recover=self.consumer.start)
        self._register(liveness.STOPPED)
        self.pool.shutdown()
        self.mailer.close()
        self.broker.close()
        log.info("worker %s stopped", self.name)

    def attach(self, broker: Broker) -> None:
        """Use ``broker`` (connected) for the queue streams."""
        self.broker = broker
        self.quarantine = Quarantine()  # one per process, over all its streams
        self.consumer = ConsumerSet(self._consumer_of, self.streams)

    def _consumer_of(self, stream: str) -> StreamConsumer:
        return StreamConsumer(
            self.broker,
            stream,
            GROUP_WORKERS,
            self.name,
            heartbeat_sec=self.settings.heartbeat_sec,
            max_deliveries=self.settings.max_deliveries,
            cipher=self.cipher,
            dead_letter_maxlen=self.settings.dead_letter_maxlen,
            owners=PostgresOwners(self.sessions, Worker),
            quarantine=self.quarantine,
        )

    def _begin(self) -> None:
        self.consumer.start()
        self._register(liveness.RUNNING)
        self._fail_left_running()
        self.pool.prestart(self.concurrency)

    def _fail_left_running(self) -> None:
        """Attempts Postgres says run on this worker's name were started by an earlier process of
        that name (this one has started none yet): their processes died with it. Fail them into
        their retries now, fenced on this name and their try. Replaying our pending entries would
        find most of them, but not one whose entry Redis lost meanwhile, and the reconciler
        cannot tell it from a live attempt: this name heartbeats again."""
        with self.sessions() as session:
            left = session.execute(
                select(TI.id, TI.try_number, TI.dag_id, TI.run_id, TI.task_id, TI.map_index).where(
                    TI.state == TaskState.RUNNING, TI.worker == self.name
                )
            ).all()
        reason = f"worker {self.name} restarted: the attempt's process died with it"
        self._fail_into_retries(
            [
                (
                    Attempt(row.id, row.try_number, self.name),
                    task_label(row.dag_id, row.run_id, row.task_id, row.map_index),
                    reason,
                )
                for row in left
            ]
        )

    def step(self) -> None:
        for periodic in self.periodic:
            periodic()
        if self.unrecorded:
            self._record(self.unrecorded)
        if self.unstarted:
            self._start(self.unstarted)
        read: list[Delivery] = []
        free = self.concurrency - len(self.running)
        if free > 0:
            # Block on Redis only when no attempt runs: else the children's results wait too.
            # The block ends when housekeeping falls due, so that it runs while nothing does and
            # not right after an entry woke the loop, between an attempt's start and its outcome
            # (where a heartbeat held up a quarter of idle_runs' resumes).
            block_ms = None if self.running else wait_ms_until_due(self.periodic, IDLE_BLOCK_MS)
            read = self.consumer.poll(free, block_ms=block_ms)
            if read:
                self._start(read)
        self._record_ended(timeout=0 if read else 0.05)
        # Stamped once a step reached PostgreSQL and Redis: the containers' healthcheck.
        metrics.LOOP_ITERATION.set_to_current_time()

    # -- leases ----------------------------------------------------------------------------------

    def _heartbeat(self) -> None:
        lost = self.consumer.renew()
        if lost:
            self._lost(lost)
        self._register(liveness.RUNNING)

    def _register(self, state: str) -> None:
        values = {
            "name": self.name,
            "hostname": self.hostname,
            "pid": os.getpid(),
            "queue": ",".join(self.queues),
            "concurrency": self.concurrency,
            "load": len(self.running),
            "state": state,
        }
        with self.sessions.begin() as session:
            liveness.heartbeat(session, Worker, values)

    def _lost(self, lost: Sequence[Lost]) -> None:
        """Entries we no longer hold. One a peer took over means our attempt was (or is being)
        failed and retried: kill its child now. One that vanished was either retired by such a
        peer, or lost with Redis's data: Postgres says which (the attempt is ours if the task
        still runs at our try, on us)."""
        status = {item.entry_id: item.status for item in lost}
        affected = [r for r in self.running.values() if r.delivery.entry.id in status]
        vanished = [r for r in affected if status[r.delivery.entry.id] is LeaseStatus.GONE]
        still_ours = self._still_running(vanished)
        killed: list[Running] = []
        for running in affected:
            if running.attempt.task_instance_id in still_ours:
                log.warning(
                    "the queue entry of %s vanished from Redis; the attempt goes on (Postgres"
                    " still says it is ours)",
                    running.label,
                    extra=running.log_ids(),
                )
                continue
            self.running.pop(running.attempt.task_instance_id)
            pid = self.pool.pid_of(running.attempt.task_instance_id)
            self.pool.kill(running.attempt.task_instance_id)
            killed.append(running)
            log.warning(
                "lost the lease on %s try %d to another worker: killed its process %s; its"
                " outcome will not count",
                running.label,
                running.attempt.try_number,
                pid,
                extra=running.log_ids(),
            )
        if killed:
            with self.sessions.begin() as session:
                said = (
                    f"worker {self.name} lost the lease on this attempt to another worker:"
                    " killed its process; its outcome will not count"
                )
                self._write_lines(session, [r.log_line(said) for r in killed])

    def _write_lines(self, session: Session, lines: Sequence[NewLine]) -> None:
        """Store the worker's lines about attempts, last in the transaction that records what
        they say (task_log_try row locks are taken last: see tasklogs.append)."""
        tasklogs.append(session, lines, self.settings.task_log_max_bytes)

    def _still_running(self, candidates: Sequence[Running]) -> set[int]:
        if not candidates:
            return set()
        keys = [(r.attempt.task_instance_id, r.attempt.try_number) for r in candidates]
        with self.sessions() as session:
            return set(
                session.scalars(
                    select(TaskInstance.id).where(
                        tuple_(TaskInstance.id, TaskInstance.try_number).in_(keys),
                        TaskInstance.state == TaskState.RUNNING,
                        TaskInstance.worker == self.name,
                    )
                )
            )

    def _take_over(self) -> None:
        free = self.concurrency - len(self.running)
        if free > 0:
            claimed = self.consumer.claim(free)
            if claimed:
                self._start(claimed)

    # -- starting attempts -----------------------------------------------------------------------

    def _start(self, deliveries: Sequence[Delivery]) -> None:
        """Start the attempts a batch of entries names, in one transaction."""
        checked: list[tuple[Delivery, QueuedAttempt]] = []
        unreadable: list[tuple[Delivery, str]] = []
        for delivery in deliveries:
            try:
                item = read_queue_entry(self.cipher, delivery.entry.fields)
            except (MalformedEntry, ForgedEntry) as exc:
                unreadable.append((delivery, f"bad queue entry: {exc}"))
                continue
            except Exception as exc:  # unforeseen bad data: it alone is set aside, not the loop
                reason = f"unreadable queue entry: {type(exc).__name__}: {exc}"
                unreadable.append((delivery, reason))
                continue
            if self.consumer.exhausted(delivery):
                self._poisoned(delivery, item)
                continue
            checked.append((delivery, item))
        self.consumer.dead_letter_many(unreadable)
        if not checked:
            return
        self.unstarted = [delivery for delivery, _ in checked]
        with self.sessions.begin() as session:
            started = transitions.start_many(
                session,
                [(item.task_instance_id, item.try_number) for _, item in checked],
                self.hostname,
                self.name,
                started_by=f"on worker {self.name} ({self.hostname})",
            )
            lines: list[NewLine] = []
            requests = self._requests(started, lines, session)
            self._write_lines(session, lines)
        self.unstarted = []
        finished: list[Delivery] = []
        orphans: list[tuple[Delivery, QueuedAttempt]] = []
        for delivery, item in checked:
            request = requests.pop(item.task_instance_id, None)
            if request is not None:
                self._submit(delivery, item, request)
            elif delivery.taken_from is not None and item.task_instance_id not in self.running:
                orphans.append((delivery, item))
            else:
                if item.task_instance_id not in {ti.id for ti in started}:
                    log.info(
                        "skipping %s: not queued at try %d (duplicate or stale)",
                        item.task,
                        item.try_number,
                        extra=_item_ids(item),
                    )
                finished.append(delivery)
        if orphans:
            self._fail_orphans(orphans)
        self.consumer.retire([d.entry for d in finished + [d for d, _ in orphans]])

    def _submit(self, delivery: Delivery, item: QueuedAttempt, request: AttemptRequest) -> None:
        ti_id = item.task_instance_id
        self.pool.submit(ti_id, encode(request))
        self.running[ti_id] = Running(
            delivery, Attempt(ti_id, item.try_number, self.name), item.task
        )
        resuming = f" (resuming at {request.next_method})" if request.next_method else ""
        log.info("running %s try %d%s", item.task, item.try_number, resuming, extra=_item_ids(item))

    def _requests(
        self, started: Sequence[transitions.Started], lines: list[NewLine], session: Session
    ) -> dict[int, AttemptRequest]:
        """The child's request for each started attempt; one that cannot be run (its run is
        gone, its resume kwargs cannot be opened) fails here, with the reason, instead of
        blocking the queue. Says in ``lines`` which failed (the start statement wrote every
        started try's start line)."""
        requests: dict[int, AttemptRequest] = {}
        for ti in started:
            try:
                if not ti.run_exists:
                    raise LookupError(f"DAG run {ti.dag_id} {ti.run_id} no longer exists")
                next_kwargs = record.resume_kwargs(self.cipher, ti.next_kwargs, ti.next_event)
            except (LookupError, DecryptionError, SerializationError) as exc:
                reason = f"cannot run: {exc}"
                transitions.fail(
                    session, Attempt(ti.id, ti.try_number, self.name), reason, allow_retry=False
                )
                lines.append(_line(ti.id, ti.try_number, f"{reason}: failed"))
                log.error(
                    "failed task instance %d: %s",
                    ti.id,
                    reason,
                    extra=log_ids(task_instance_id=ti.id, try_number=ti.try_number),
                )
                continue
            requests[ti.id] = record.request_of(ti, next_kwargs, self.settings.task_log_max_bytes)
        return requests

    def _fail_orphans(self, orphans: Sequence[tuple[Delivery, QueuedAttempt]]) -> None:
        """Attempts of workers that stopped heartbeating (or of this worker's earlier process):
        fail them into a retry, so they are never lost and never run twice at once. Fenced on
        that worker: the same try may since have been resumed from a deferral and be running on
        a live worker."""
        failures = []
        for delivery, item in orphans:
            assert delivery.taken_from is not None
            attempt = Attempt(item.task_instance_id, item.try_number, delivery.taken_from)
            failures.append(
                (attempt, item.task, f"worker {delivery.taken_from} stopped heartbeating")
            )
        self._fail_into_retries(failures)

    def _fail_into_retries(self, failures: Sequence[tuple[Attempt, str, str]]) -> None:
        """Fail each (attempt, task label, reason) whose try still runs on that attempt's worker
        into its retry, in one transaction, saying so in the log and in the try's log."""
        with self.sessions.begin() as session:
            lines = []
            for attempt, label, reason in failures:
                state = transitions.fail(session, attempt, reason, allow_retry=True)
                if state is not None:
                    ids = log_ids(
                        task=label,
                        task_instance_id=attempt.task_instance_id,
                        try_number=attempt.try_number,
                    )
                    log.warning("%s: %s; now %s", label, reason, state, extra=ids)
                    lines.append(
                        _line(
                            attempt.task_instance_id, attempt.try_number, f"{reason}; now {state}"
                        )
                    )
            self._write_lines(session, lines)

    def _poisoned(self, delivery: Delivery, item: QueuedAttempt) -> None:
        reason = f"queue entry of {item.task} {self.consumer.exhausted_reason(delivery)}"
        with self.sessions.begin() as session:
            if transitions.fail_poisoned(session, item.task_instance_id, item.try_number, reason):
                self._write_lines(
                    session, [_line(item.task_instance_id, item.try_number, f"{reason}: failed")]
                )
        self.consumer.dead_letter(delivery, reason)

    # -- recording outcomes ----------------------------------------------------------------------

    def _record_ended(self, timeout: float) -> None:
        ended = self.pool.collect(timeout)
        if not ended:
            return
        batch: list[tuple[Running, Outcome]] = []
        for ti_id, result in ended:
            running = self.running.pop(ti_id, None)
            if running is None:
                continue
            outcome = (
                Failed(result.describe(), "", allow_retry=True)
                if isinstance(result, ChildDied)
                else decode_outcome(result)
            )
            batch.append((running, outcome))
        self._record(batch)

    def _record(self, batch: Sequence[tuple[Running, Outcome]]) -> None:
        """Record a batch of outcomes in one transaction, then publish and retire; a batch that
        fails on bad data is recorded one outcome at a time, so the bad one fails alone."""
        self.unrecorded = list(batch)
        self.tally, self.mails = Counter(), []
        staged: list[outbox.Staged] = []
        try:
            with self.sessions.begin() as session:
                staged = self._apply_batch(session, batch)
        except Exception as exc:
            if is_transient(exc):
                raise
            log.exception("recording %d outcomes together failed; one by one now", len(batch))
            staged, self.tally, self.mails = [], Counter(), []  # that transaction rolled back
            for running, outcome in batch:
                staged += self._record_alone(running, outcome)
        self.unrecorded = []
        self.mailer.send(self.mails)
        if any(count for label, count in self.tally.items() if label != "dropped"):
            # A task that ended marked its run, and any recorded outcome freed its pool slot
            # and its DAG's active-task budget: a scheduler looks now, not when its wait for
            # events ends. (Downstream tasks of a success start sooner; and a pool's queued tasks
            # drain about as fast as a scheduler's wait for events, so a scheduler that waited
            # that long let the workers idle.)
            self.broker.publish(self.keys.events, WAKE)
        for outcome_label, count in self.tally.items():
            metrics.TASK_ATTEMPTS.labels(outcome_label).inc(count)
        outbox.flush(self.sessions, self.broker, staged)
        self.consumer.retire(
            [r.delivery.entry for r, _ in batch if self.consumer.holds(r.delivery.entry.id)]
        )

    def _record_alone(self, running: Running, outcome: Outcome) -> list[outbox.Staged]:
        before, mails_before = self.tally.copy(), len(self.mails)
        try:
            with self.sessions.begin() as session:
                return self._apply_batch(session, [(running, outcome)])
        except Exception as exc:
            if is_transient(exc):
                raise
            # What that transaction said did not happen.
            self.tally, self.mails = before, self.mails[:mails_before]
            reason = f"cannot record its outcome: {type(exc).__name__}: {exc}"
            log.exception("%s %s", running.label, reason, extra=running.log_ids())
            with self.sessions.begin() as session:
                if transitions.fail(session, running.attempt, reason, allow_retry=False):
                    self._write_lines(session, [running.log_line(f"{reason}: failed")])
                    self.tally["failed"] += 1
            return []

    def _apply_batch(
        self, session: Session, batch: Sequence[tuple[Running, Outcome]]
    ) -> list[outbox.Staged]:
        """Successes and deferrals, the common outcomes, in a few statements for the whole
        batch; the rest one by one."""
        successes = [(r, o) for r, o in batch if isinstance(o, Succeeded)]
        deferrals = [(r, o) for r, o in batch if isinstance(o, Deferred)]
        lines: list[NewLine] = []
        succeeded = record.succeed_all(session, [(r.attempt, o) for r, o in successes])
        for running, success in successes:
            moved = running.attempt.task_instance_id in succeeded
            self._say(running, success, moved, "succeeded", lines)
        staged = self._defer_many(session, deferrals, lines)
        for running, other in batch:
            if isinstance(other, Rescheduled | Skipped | Failed | AwaitingInput):
                self._apply_other(session, running, other, lines)
        self._write_lines(session, lines)
        return staged

    def _say(
        self, running: Running, outcome: Outcome, moved: bool, said: str, lines: list[NewLine]
    ) -> None:
        """Log what became of an attempt, and add it to the try's log ``lines`` if it counts;
        tally it for the metrics."""
        self.tally[_OUTCOME_LABELS[type(outcome)] if moved else "dropped"] += 1
        if moved:
            level = logging.ERROR if isinstance(outcome, Failed) else logging.INFO
            log.log(level, "%s %s", running.label, said, extra=running.log_ids())
            lines.append(running.log_line(said))
        else:
            log.warning(
                "%s try %d: outcome dropped, the attempt is no longer this worker's (its lease was"
                " taken over)",
                running.label,
                running.attempt.try_number,
                extra=running.log_ids(),
            )

    def _apply_other(
        self,
        session: Session,
        running: Running,
        outcome: Rescheduled | Skipped | Failed | AwaitingInput,
        lines: list[NewLine],
    ) -> None:
        moved, said = record.apply_other(session, running.attempt, outcome)
        if moved and isinstance(outcome, Failed) and outcome.alert is not None:
            self.mails.append(Mail(outcome.alert, running.label, running.log_ids()))
        self._say(running, outcome, moved, said, lines)

    def _defer_many(
        self,
        session: Session,
        deferrals: Sequence[tuple[Running, Deferred]],
        lines: list[NewLine],
    ) -> list[outbox.Staged]:
        """Write the deferrals' trigger rows and move their tasks, then stage their trigger
        entries; returns the outbox rows of those that moved."""
        horizon = dt.timedelta(seconds=self.settings.far_timer_horizon_sec)
        specs = [
            record.deferral_of(running.attempt, outcome, self.cipher, horizon)
            for running, outcome in deferrals
        ]
        # Signal waits are rows, not triggers run in a triggerer: no trigger entry for them.
        waits = {
            running.attempt.task_instance_id: wait
            for running, outcome in deferrals
            if (wait := record.wait_of(running.attempt, outcome)) is not None
        }
        joined: set[int] = set()
        moved = signals.defer_with_waits(session, self.cipher, specs, waits, joined)
        messages = []
        for (running, outcome), spec in zip(deferrals, specs, strict=True):
            ti_id = running.attempt.task_instance_id
            trigger_id = moved.get(ti_id)
            said = f"deferred to trigger {trigger_id} ({outcome.classpath})"
            if spec.far_moment is not None:
                said += f"; a far timer, published {horizon} before its moment"
            self._say(running, outcome, trigger_id is not None, said, lines)
            if trigger_id is None or (ti_id in waits and waits[ti_id].holds) or ti_id in joined:
                continue  # a signal wait has no entry; a shared trigger already made has its own
            if spec.far_moment is not None:
                continue  # a far timer waits as a row: the scheduler publishes it when near
            message = trigger_message(
                self.cipher,
                trigger_id=trigger_id,
                classpath=outcome.classpath,
                kwargs=outcome.trigger_kwargs,
                task_instance_id=ti_id,
                try_number=running.attempt.try_number,
                task=running.label,
            )
            queue = self.queue_of[running.delivery.entry.stream]
            messages.append((self.keys.trigger_stream(queue, trigger_id), message))
        return outbox.stage_many(session, messages)
