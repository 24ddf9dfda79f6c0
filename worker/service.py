"""``worker consume``: reads task attempts from its queue stream and runs them in child processes.

The loop only moves messages and applies outcomes, a batch at a time: the entries read together
start in one statement, the attempts that ended together are recorded in one transaction and
their entries retired in one call. Each attempt runs in a reusable child process
(:mod:`worker.children`), and every outcome is fenced on (task instance, try, worker): a worker that
lost its lease kills that attempt's child and changes nothing in Postgres.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence

from sqlalchemy import select, tuple_

from broker.client import Broker, LeaseStatus
from broker.consumer import Delivery, Lost, run_until_stopped
from broker.consumers import ConsumerSet
from broker.owners import PostgresOwners
from broker.service import (
    Registration,
    consumer_set,
    hand_off,
    heartbeat,
    poisoned,
    read_each,
    serve,
)
from broker.streams import (
    GROUP_WORKERS,
    QueuedAttempt,
    StreamKeys,
    read_queue_entry,
    task_label,
)
from deferral.runtime import metrics
from deferral.runtime.config import Settings, SmtpSettings
from deferral.runtime.crypto import Cipher, DecryptionError
from deferral.runtime.process import Every, LogExtra, log_ids, wait_ms_until_due
from deferral.runtime.serialization import SerializationError
from deferral.states import TaskState
from deferral.store import liveness, transitions
from deferral.store.db import make_engine, make_sessionmaker, one_statement
from deferral.store.tables import TaskInstance, Worker
from deferral.store.transitions import Attempt
from worker import decide, record
from worker.attempt import warm_up
from worker.capture import run_attempt
from worker.children import ChildDied, ChildPool
from worker.mail import Mailer
from worker.outcomes import AttemptRequest, Failed, Outcome, decode_outcome, encode
from worker.recording import Recorder, Running, line, write_lines
from worker.stopping import hand_back

log = logging.getLogger("deferral.worker")

TI = TaskInstance
# The longest a worker with no attempt running waits on Redis for entries.
IDLE_BLOCK_MS = 1000


def _item_ids(item: QueuedAttempt) -> LogExtra:
    """``extra=`` for a log line about a queue entry's attempt."""
    return log_ids(
        task=item.task, task_instance_id=item.task_instance_id, try_number=item.try_number
    )


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
        self.queues = tuple(queues)
        self.concurrency = concurrency
        self.cipher = Cipher(settings.fernet_keys)
        self.engine = make_engine(settings.database_url)
        self.sessions = make_sessionmaker(self.engine)
        self.registration = Registration(
            self.sessions,
            Worker,
            name,
            lambda: {
                "queue": ",".join(self.queues),
                "concurrency": self.concurrency,
                "load": len(self.running),
            },
        )
        self.hostname = self.registration.hostname
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
        # Work read but not yet started because the servers failed: retried first.
        self.unstarted: list[Delivery] = []
        self.mailer = Mailer(smtp)
        self.broker: Broker
        self.consumer: ConsumerSet
        self.recorder: Recorder
        beat = settings.heartbeat_sec
        # Takeovers are looked for more often than leases are renewed: an entry is claimed soon
        # after it passes the takeover threshold, not up to a heartbeat later.
        self.heartbeats = Every(beat, self._heartbeat)
        self.periodic = [self.heartbeats, Every(beat / 4, self._take_over)]
        metrics.ATTEMPTS_RUNNING.set_function(lambda: len(self.running))
        metrics.WORKER_SLOTS_FREE.set_function(lambda: self.concurrency - len(self.running))

    # -- the loop --------------------------------------------------------------------------------

    def run(self, stop: threading.Event) -> None:
        if not serve(
            stop,
            self.settings,
            self.engine,
            attach=self.attach,
            begin=self._begin,
            step=self.step,
            recover=lambda: self.consumer.start(),
            started=lambda: log.info(
                "worker %s consuming %s with %d slots",
                self.name,
                ", ".join(self.streams),
                self.concurrency,
            ),
        ):
            return
        _wind_down(self)
        hand_off(self.consumer, "queue entr(ies)")  # read, not started: a peer starts them
        self.registration.record_stop()
        self.pool.shutdown()
        self.mailer.close()
        self.broker.close()
        log.info("worker %s stopped", self.name)

    def attach(self, broker: Broker) -> None:
        """Use ``broker`` (connected) for the queue streams."""
        self.broker = broker
        self.consumer = consumer_set(
            broker,
            self.streams,
            group=GROUP_WORKERS,
            name=self.name,
            settings=self.settings,
            cipher=self.cipher,
            owners=PostgresOwners(self.sessions, Worker),
        )
        self.recorder = Recorder(
            self.settings,
            name=self.name,
            sessions=self.sessions,
            cipher=self.cipher,
            keys=self.keys,
            broker=broker,
            consumer=self.consumer,
            queue_of=self.queue_of,
            mailer=self.mailer,
        )

    def _begin(self) -> None:
        self.consumer.start()
        self.registration.record(liveness.RUNNING)
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
        if self.recorder.unrecorded:
            self.recorder.record(self.recorder.unrecorded)
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
        self.record_ended(timeout=0 if read else 0.05)
        # Stamped once a step reached PostgreSQL and Redis: the containers' healthcheck.
        metrics.LOOP_ITERATION.set_to_current_time()

    # -- leases ----------------------------------------------------------------------------------

    def _heartbeat(self) -> None:
        heartbeat(self.consumer, self.registration, self._lost)

    def _lost(self, lost: Sequence[Lost]) -> None:
        """Entries we no longer hold. One a peer took over means our attempt was (or is being)
        failed and retried: kill its child now. One that vanished was either retired by such a
        peer, or lost with Redis's data: Postgres says which (the attempt is ours if the task
        still runs at our try, on us)."""
        status = {item.key: item.status for item in lost}
        affected = [r for r in self.running.values() if r.delivery.entry.key in status]
        vanished = [r for r in affected if status[r.delivery.entry.key] is LeaseStatus.GONE]
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
                write_lines(session, [r.log_line(said) for r in killed], self.settings)

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
        free = self.concurrency - len(self.running) - len(self.unstarted)
        if free > 0:
            claimed = self.consumer.claim(free)
            if claimed:
                self._start(claimed)

    # -- starting attempts -----------------------------------------------------------------------

    def _start(self, deliveries: Sequence[Delivery]) -> None:
        """Start the attempts a batch of entries names, in one transaction, with those a start
        that failed (the database unavailable) left unstarted: a takeover's start, which runs
        first when the database is back, replaced them, and they stayed held, their leases
        renewed, their tasks queued for ever (worker/DECISIONS.md 24). An attempt whose failed
        start committed all the same for this worker is run now (rule 28)."""
        # Their start's statement failed: it may have committed all the same (worker rule 28).
        unsure = {d.entry.key for d in self.unstarted}
        if deliveries is not self.unstarted:
            deliveries = [*self.unstarted, *deliveries]
        read, unreadable = read_each(
            deliveries,
            lambda delivery: read_queue_entry(self.cipher, delivery.entry.fields),
            "queue entry",
        )
        checked: list[tuple[Delivery, QueuedAttempt]] = []
        for delivery, item in read:
            reason = poisoned(self.consumer, delivery, f"queue entry of {item.task}")
            if reason is not None:
                self._poisoned(delivery, item, reason)
            else:
                checked.append((delivery, item))
        self.consumer.dead_letter_many(unreadable)
        if not checked:
            return
        self.unstarted = [delivery for delivery, _ in checked]
        adopting = self._adoptable(checked, unsure) if unsure else []
        # One statement (it writes the start lines too): committed on its own, without BEGIN
        # and COMMIT round trips between the entry and the task's code (worker rule 25).
        with one_statement(self.sessions) as session:
            started = transitions.start_many(
                session,
                [(item.task_instance_id, item.try_number) for _, item in checked],
                self.hostname,
                self.name,
                started_by=f"on worker {self.name} ({self.hostname})",
                adopting=adopting,
            )
        self.unstarted = []
        requests, cannot_run = self._requests(started)
        finished: list[Delivery] = []
        orphans: list[tuple[Delivery, QueuedAttempt]] = []
        failing: list[tuple[Running, Outcome]] = []
        for delivery, item in checked:
            request = requests.pop(item.task_instance_id, None)
            if request is not None:
                self._submit(delivery, item, request)
            elif item.task_instance_id in cannot_run:
                attempt = Attempt(item.task_instance_id, item.try_number, self.name)
                reason = cannot_run[item.task_instance_id]
                failing.append(
                    (Running(delivery, attempt, item.task), Failed(reason, "", allow_retry=False))
                )
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
        if failing:
            # Recorded as the attempts' outcomes: fenced, with their lines, kept and recorded
            # again if the servers fail, their entries retired. With the outcomes a failed
            # record left (a takeover's start runs before the step retries them): a record
            # keeps only the batch it is given.
            self.recorder.record([*self.recorder.unrecorded, *failing])

    def _adoptable(
        self, checked: Sequence[tuple[Delivery, QueuedAttempt]], unsure: set[tuple[str, str]]
    ) -> list[tuple[int, int]]:
        """The attempts of entries whose failed start may have committed (``unsure``) that
        this worker neither runs nor has run (in ``running``, or an outcome not yet recorded)."""
        ours = self.running.keys() | {
            r.attempt.task_instance_id for r, _ in self.recorder.unrecorded
        }
        return [
            (item.task_instance_id, item.try_number)
            for delivery, item in checked
            if delivery.entry.key in unsure and item.task_instance_id not in ours
        ]

    def _submit(self, delivery: Delivery, item: QueuedAttempt, request: AttemptRequest) -> None:
        ti_id = item.task_instance_id
        self.pool.submit(ti_id, encode(request))
        self.running[ti_id] = Running(
            delivery, Attempt(ti_id, item.try_number, self.name), item.task
        )
        resuming = f" (resuming at {request.next_method})" if request.next_method else ""
        log.info("running %s try %d%s", item.task, item.try_number, resuming, extra=_item_ids(item))

    def _requests(
        self, started: Sequence[transitions.Started]
    ) -> tuple[dict[int, AttemptRequest], dict[int, str]]:
        """The child's request for each started attempt, and why each that cannot be run (its
        run is gone, its resume kwargs cannot be opened) cannot: those fail, with the reason,
        instead of blocking the queue."""
        requests: dict[int, AttemptRequest] = {}
        cannot_run: dict[int, str] = {}
        for ti in started:
            try:
                if not ti.run_exists:
                    raise LookupError(f"DAG run {ti.dag_id} {ti.run_id} no longer exists")
                next_kwargs = record.resume_kwargs(self.cipher, ti.next_kwargs, ti.next_event)
            except (LookupError, DecryptionError, SerializationError) as exc:
                cannot_run[ti.id] = f"cannot run: {exc}"
                continue
            requests[ti.id] = record.request_of(ti, next_kwargs, self.settings.task_log_max_bytes)
        return requests, cannot_run

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
                        line(attempt.task_instance_id, attempt.try_number, f"{reason}; now {state}")
                    )
            write_lines(session, lines, self.settings)

    def _poisoned(self, delivery: Delivery, item: QueuedAttempt, reason: str) -> None:
        with self.sessions.begin() as session:
            if transitions.fail_poisoned(session, item.task_instance_id, item.try_number, reason):
                said = line(item.task_instance_id, item.try_number, f"{reason}: failed")
                write_lines(session, [said], self.settings)
        self.consumer.dead_letter(delivery, reason)

    # -- recording outcomes ----------------------------------------------------------------------

    def record_ended(self, timeout: float) -> None:
        """Record the attempts whose children ended (a child that died fails its attempt, with
        a retry)."""
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
        self.recorder.record(batch)


def _wind_down(worker: WorkerService) -> None:
    """Take no more work; let the running attempts finish for up to the stop grace, then hand
    the rest back untried (:func:`worker.stopping.hand_back`)."""
    grace = worker.settings.worker_stop_grace_sec
    log.info(
        "stopping: taking no more work; %d running attempt(s) may finish for %g s",
        len(worker.running),
        grace,
    )
    handing_back_at = time.monotonic() + grace
    drained = threading.Event()

    def drain() -> None:
        worker.heartbeats()  # the leases must outlive the attempts we wait for; no takeovers
        if worker.recorder.unrecorded:
            worker.recorder.record(worker.recorder.unrecorded)
        worker.record_ended(timeout=0.5)
        action = decide.stop_action(
            time.monotonic(),
            handing_back_at,
            len(worker.running),
            len(worker.recorder.unrecorded),
        )
        if action == "hand_back":
            left = list(worker.running.values())
            hand_back(
                left,
                name=worker.name,
                pool=worker.pool,
                sessions=worker.sessions,
                consumer=worker.consumer,
                settings=worker.settings,
            )
            for item in left:
                worker.running.pop(item.attempt.task_instance_id, None)
        elif action == "done":
            drained.set()

    run_until_stopped(drained, drain, recover=worker.consumer.start)
