"""``scheduler consume``: starts DAG runs, evaluates the runs something changed in, dispatches
scheduled tasks, applies trigger events (deferred -> scheduled, and queued in the same batch),
expires deferrals, wakes retries and reschedules, relays the outbox, reconciles Redis with
Postgres and prunes history.

A loop's cost depends on what changed, not on how many runs exist: every transition that may let
a run move on marks that run (``dag_run.evaluate_after``), and only marked runs are read; time-based
work (deferral timeouts, retries, reschedules) is one indexed statement each. Several replicas may
run: runs and rows are taken with ``FOR UPDATE SKIP LOCKED``, events are dedup-keyed.
"""

from __future__ import annotations

import datetime as dt
import logging
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

from sqlalchemy import select, text, tuple_

from broker import outbox
from broker.client import Broker
from broker.consumers import ConsumerSet
from broker.owners import PostgresOwners
from broker.service import Registration, consumer_set, hand_off, heartbeat, serve
from broker.streams import GROUP_SCHEDULERS, StreamKeys
from deferral.authoring.callbacks import (
    REASON_TIMED_OUT,
    run_dag_callbacks,
)
from deferral.context import DagRunInfo
from deferral.dag import DAG
from deferral.loading.dagbag import DagBag
from deferral.loading.parsing import FolderParser, Parsed
from deferral.runtime import metrics
from deferral.runtime.config import Settings
from deferral.runtime.crypto import Cipher
from deferral.runtime.process import Every, wait_ms_until_due
from deferral.states import DagRunState
from deferral.store import transitions
from deferral.store.db import make_engine, make_sessionmaker
from deferral.store.tables import DagRun, Scheduler
from scheduler import (
    assets,
    dagruns,
    dags,
    decide,
    far_timers,
)
from scheduler.dispatch import Dispatcher
from scheduler.evaluation import RUN_BATCH, RunEvaluator, run_dates
from scheduler.events import EventApplier
from scheduler.housekeeping import Housekeeping
from scheduler.reconcile import Reconciler
from scheduler.waiting import new_task_instance

log = logging.getLogger("deferral.scheduler")

EVENT_BLOCK_MS = 100
# Queued runs started per transaction: a catch-up or a burst of triggers starts in batches.
START_BATCH = 500
EXPIRE_EVERY_SEC = 1.0
WAKE_EVERY_SEC = 0.5
RELAY_EVERY_SEC = 5.0
RELAY_AFTER = dt.timedelta(seconds=10)
RECONCILE_EVERY_SEC = 2.0
# Far timers come due within the horizon (minutes): a second's delay is nothing to them.
FAR_TIMERS_EVERY_SEC = 1.0
# Runs of DAGs that stopped loading are looked at this often, or twice per grace period if
# that is shorter (at most every 0.5 s): a run fails at most 5 s, or half its grace, after it.
BROKEN_DAGS_EVERY_SEC = 5.0
PRUNE_EVERY_SEC = 3600.0
# The history tables' partitions of the next days are made this often (deferral.store.partitions).
PARTITIONS_EVERY_SEC = 3600.0
# The hot tables' planner statistics are checked this often (deferral.store.statistics).
ANALYZE_EVERY_SEC = 5.0
SCHEDULE_RUNS_EVERY_SEC = 1.0
RECOLLECT_MISSING_SEC = 1.0
# The longest a loop waits for the folder read a missing DAG started, as a share of a heartbeat
# (a file written and triggered at once starts in that loop; a slow folder holds no heartbeat).
MISSING_DAG_WAIT_BEATS = 0.4

# Runs marked for evaluation, counted up to :most (ix_dag_run_evaluate_after): how far the
# evaluation pass is behind the start pass.
_MARKED_BACKLOG_SQL = text(
    """
    SELECT count(*) FROM (
        SELECT 1 FROM dag_run WHERE evaluate_after <= now() AND state = 'running' LIMIT :most
    ) AS marked
    """
)
# Which of a loop's passes have anything to do, in one indexed statement (three index probes):
# a loop with nothing to start, evaluate or queue then costs this one round trip instead of
# three transactions, the time an event arriving meanwhile waited for.
_LOOP_WORK_SQL = text(
    """
    SELECT EXISTS (SELECT 1 FROM dag_run WHERE state = 'queued') AS queued_runs,
           EXISTS (SELECT 1 FROM dag_run
                   WHERE evaluate_after <= now() AND state = 'running') AS marked_runs,
           EXISTS (SELECT 1 FROM task_instance WHERE state = 'scheduled') AS scheduled_tasks
    """
)


class SchedulerService:
    def __init__(self, settings: Settings, *, name: str) -> None:
        self.settings = settings
        self.name = name
        self.cipher = Cipher(settings.fernet_keys)
        self.engine = make_engine(settings.database_url)
        self.sessions = make_sessionmaker(self.engine)
        self.keys = StreamKeys.for_redis(
            settings.stream_prefix, settings.redis_url, settings.stream_shards
        )
        self.dagbag = DagBag(settings.dags_folder)
        # Reads the folder off the loop: a file whose import never finishes costs an import
        # error after DEFERRAL_DAGBAG_IMPORT_TIMEOUT, never a heartbeat (DECISIONS.md).
        self.parser = FolderParser(self.dagbag, settings.dagbag_import_timeout)
        # The DAGs of the last read the loop took over; `_unrecorded`: one taken but not yet
        # written to the dag and import_error tables.
        self.dags: dict[str, DAG] = {}
        self._unrecorded: Parsed | None = None
        self._collected_at = 0.0  # monotonic time of the last read asked for a missing DAG
        # When the DAGs folder was last read (any collect): a run's DAG is missing for sure only
        # if the folder was read after the run was created.
        self._folder_read_at = dt.datetime.min.replace(tzinfo=dt.UTC)
        # DAG callbacks run in these threads.
        self.callbacks = ThreadPoolExecutor(max_workers=2, thread_name_prefix="dag-callbacks")
        self.registration = Registration(self.sessions, Scheduler, name)
        self.dispatcher = Dispatcher(
            self.keys, self.cipher, self._dag, resumed_first=settings.resumed_first
        )
        self.evaluator = RunEvaluator(
            name=name,
            max_map_length=settings.max_map_length,
            cipher=self.cipher,
            keys=self.keys,
            dispatcher=self.dispatcher,
            dag=self._dag,
        )
        self.broker: Broker
        self.consumer: ConsumerSet
        self.events: EventApplier
        self.reconciler: Reconciler
        beat = settings.heartbeat_sec
        broken_every = min(BROKEN_DAGS_EVERY_SEC, max(settings.dag_import_grace_sec / 2, 0.5))
        housekeeping = self.housekeeping = Housekeeping(
            settings,
            engine=self.engine,
            sessions=self.sessions,
            cipher=self.cipher,
            callbacks=self.callbacks,
            dags=lambda: self.dags,
        )
        self.periodic = [
            Every(settings.dag_refresh_sec, self.parser.start),
            Every(beat, self.heartbeat),
            Every(beat / 4, lambda: self.events.take_over()),
            Every(EXPIRE_EVERY_SEC, housekeeping.expire_deferrals),
            Every(EXPIRE_EVERY_SEC, housekeeping.fire_wait_timers),
            Every(EXPIRE_EVERY_SEC, housekeeping.fail_missed_heartbeats),
            Every(EXPIRE_EVERY_SEC, housekeeping.expire_input_requests),
            Every(EXPIRE_EVERY_SEC, housekeeping.record_deadline_misses),
            Every(WAKE_EVERY_SEC, housekeeping.wake_due),
            Every(RELAY_EVERY_SEC, self.relay_outbox),
            Every(RECONCILE_EVERY_SEC, self.reconcile),
            Every(FAR_TIMERS_EVERY_SEC, self.publish_far_timers),
            Every(broken_every, self.fail_broken_runs),
            Every(PRUNE_EVERY_SEC, housekeeping.prune),
            Every(PARTITIONS_EVERY_SEC, housekeeping.make_partitions),
            Every(ANALYZE_EVERY_SEC, housekeeping.analyze_changed_tables),
            Every(SCHEDULE_RUNS_EVERY_SEC, self.schedule_runs),
        ]

    def run(self, stop: threading.Event) -> None:
        if not serve(
            stop,
            self.settings,
            self.engine,
            attach=self.attach,
            begin=lambda: self.consumer.start(),
            step=self.step,
            recover=lambda: self.consumer.start(),
            started=lambda: log.info("scheduler %s started", self.name),
        ):
            return
        self.parser.close()
        # The events it read and has not applied go to a live peer at once.
        hand_off(self.consumer, "event entr(ies)")
        self.registration.record_stop()
        self.callbacks.shutdown(wait=True)
        self.broker.close()
        log.info("scheduler %s stopped", self.name)

    def attach(self, broker: Broker) -> None:
        """Use ``broker`` (connected) for the streams."""
        self.broker = broker
        self.consumer = consumer_set(
            broker,
            self.keys.all_events,
            group=GROUP_SCHEDULERS,
            name=self.name,
            settings=self.settings,
            cipher=self.cipher,
            owners=PostgresOwners(self.sessions, Scheduler),
        )
        self.events = EventApplier(
            self.settings,
            sessions=self.sessions,
            cipher=self.cipher,
            broker=broker,
            consumer=self.consumer,
            dispatcher=self.dispatcher,
            callbacks=self.callbacks,
            dag=self._dag,
        )
        self.reconciler = Reconciler(
            self.sessions, broker, self.cipher, self.settings.heartbeat_sec
        )
        metrics.STREAMS.watch(broker.stream_stats)
        metrics.DEFERRED.watch(self.housekeeping.deferred_by_trigger_class)

    def heartbeat(self) -> None:
        """Renew the leases on the events held and refresh this scheduler's row, which
        ``deferral health`` reads."""
        heartbeat(self.consumer, self.registration)

    def step(self) -> None:
        self.record_parsed_dags()
        for periodic in self.periodic:
            periodic()
        with self.engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            work = conn.execute(_LOOP_WORK_SQL).one()
        # Each pass feeds the next in the same loop (a started run is marked, an evaluated run
        # schedules tasks): one with work runs every pass after it.
        if work.queued_runs:
            self.start_queued_runs()
            # A read taken over while starting them is recorded before their tasks can queue:
            # a task process finds its DAG's file in the dag row.
            self.record_parsed_dags()
        if work.queued_runs or work.marked_runs:
            self.evaluate_marked_runs()
        busy = work.queued_runs or work.marked_runs or work.scheduled_tasks
        queued = self.dispatch_scheduled() if busy else 0
        # Wait for events only when this loop queued nothing: else slots may be freeing up. The
        # wait ends when housekeeping is due, not on a grid set by the last wake-up.
        self.events.apply(
            block_ms=None if queued else wait_ms_until_due(self.periodic, EVENT_BLOCK_MS)
        )
        # Stamped once a step reached PostgreSQL and Redis: the containers' healthcheck.
        metrics.LOOP_ITERATION.set_to_current_time()

    # -- DAGs ------------------------------------------------------------------------------------

    def refresh_dags(self) -> None:
        """Read the folder now, in this thread, and record what it holds."""
        self._adopt(self.parser.parse())
        self.record_parsed_dags()

    def record_parsed_dags(self) -> None:
        """Take over a read of the folder finished in the background, and write what the last
        one taken over found to the dag, import_error and asset tables."""
        finished = self.parser.take()
        if finished is not None:
            self._adopt(finished)
        parsed, self._unrecorded = self._unrecorded, None
        if parsed is None:
            return
        with self.sessions.begin() as session:
            recordable = self.parser.settled(parsed)
            back = dags.record(session, str(self.settings.dags_folder), recordable)
            assets.sync_assets(
                session,
                parsed.dags,
                self.cipher,
                whole_folder=not parsed.pending and not parsed.import_errors,
            )
            transitions.mark_runs(session, dags.runs_of(session, back))

    def _adopt(self, parsed: Parsed) -> None:
        """Evaluate runs with ``parsed``'s DAGs from now on (recorded by the next step: this
        may be called inside a transaction that holds DAG rows)."""
        self.dags = parsed.dags
        if not parsed.pending:  # an interim read has not looked at every file yet
            self._folder_read_at = max(self._folder_read_at, parsed.started_at)
        self._unrecorded = parsed

    def schedule_runs(self) -> None:
        """Create the scheduled runs that are due; fail runs past their dagrun_timeout."""
        now = dt.datetime.now(dt.UTC)
        with self.sessions.begin() as session:
            dagruns.create_due_runs(session, self.dags, now)
            assets.create_runs(session, self.dags, now)
            timed_out = dagruns.fail_timed_out_runs(session, self.dags, now)
            runs = (
                session.scalars(
                    select(DagRun).where(tuple_(DagRun.dag_id, DagRun.run_id).in_(timed_out))
                ).all()
                if timed_out
                else []
            )
        finished = [
            (dag, run, False, REASON_TIMED_OUT) for run in runs if (dag := self._dag(run.dag_id))
        ]
        self._call_back(finished)

    def _dag(self, dag_id: str) -> DAG | None:
        """The DAG as last read; one not there makes the folder be read again, at most once a
        second (a new file is found at once, yet a run of a DAG that no longer loads does not
        cost a folder scan per call: the dispatch pass asks per run). The loop waits for that
        read a share of a heartbeat at most; a slower one is taken over by a later step."""
        dag = self.dags.get(dag_id)
        if dag is None and time.monotonic() - self._collected_at >= RECOLLECT_MISSING_SEC:
            # Waited for only when asked for now: a read under way may be a slow file's.
            if self.parser.start():
                self.parser.wait(self.settings.heartbeat_sec * MISSING_DAG_WAIT_BEATS)
            finished = self.parser.take()
            self._collected_at = time.monotonic()
            if finished is not None:
                self._adopt(finished)
                dag = self.dags.get(dag_id)
        return dag

    def fail_broken_runs(self) -> None:
        grace = dt.timedelta(seconds=self.settings.dag_import_grace_sec)
        with self.sessions.begin() as session:
            dags.fail_broken_runs(session, grace)

    # -- DAG runs --------------------------------------------------------------------------------

    def start_queued_runs(self) -> None:
        """Start up to START_BATCH queued runs in one transaction, their task instances made
        and their runs moved in two statements whatever their number (scheduler/DECISIONS.md
        27); fewer while started runs wait for their first evaluation, so that a burst flows on
        to the workers instead of piling up marked."""
        with self.sessions.begin() as session:
            room = START_BATCH - session.scalar(_MARKED_BACKLOG_SQL, {"most": START_BATCH})
            started: list[tuple[DagRun, DAG]] = []
            for run in dagruns.startable_runs(session, limit=max(room, RUN_BATCH)):
                dag = self._dag(run.dag_id)
                if dag is not None:
                    started.append((run, dag))
                elif run.created_at < self._folder_read_at and not dags.grace_left(
                    session, run.dag_id
                ):
                    # (Not yet looked for since the run was created, as for a file written just
                    # before `dags trigger` within a second of the last look: the run waits.)
                    log.error("run %s of DAG %r failed: DAG not found", run.run_id, run.dag_id)
                    transitions.finish_dag_run(session, run, DagRunState.FAILED)
            transitions.start_dag_runs(
                session,
                [
                    (
                        run,
                        [
                            new_task_instance(run, t)
                            for t in decide.tasks_of_run(dag, *run_dates(run))
                        ],
                    )
                    for run, dag in started
                ],
            )
        for run, dag in started:
            self.evaluator.remember_checked(run.id, dag)
        if started:
            said = ", ".join(run.run_id for run, _ in started[:5])
            more = f" and {len(started) - 5} more" if len(started) > 5 else ""
            dag_ids = ", ".join(sorted({run.dag_id for run, _ in started}))
            log.info("started %d run(s) of %s: %s%s", len(started), dag_ids, said, more)

    def evaluate_marked_runs(self) -> None:
        """Decide what may move on in the runs marked since their last evaluation
        (``scheduler.evaluation``), and queue what became ready."""
        with self.sessions.begin() as session:
            done = self.evaluator.evaluate(session)
        if done is None:
            return
        self.evaluator.committed(done)
        self._call_back(done.finished)
        metrics.DISPATCHES.inc(len(done.staged))
        outbox.flush(self.sessions, self.broker, done.staged)

    def _call_back(self, finished: Sequence[tuple[DAG, DagRun, bool, str]]) -> None:
        """Run the DAG callbacks of runs that finished (and committed), off the loop: they are
        user code, and the loop must not wait on them."""
        for dag, run, success, reason in finished:
            if (dag.on_success_callback if success else dag.on_failure_callback) is None:
                continue
            info = DagRunInfo.of(run)
            self.callbacks.submit(run_dag_callbacks, dag, info, success=success, reason=reason)

    # -- dispatch: scheduled -> queued -----------------------------------------------------------

    def dispatch_scheduled(self) -> int:
        """Queue scheduled tasks (of any run) that pools and run budgets let through; returns
        how many."""
        with self.sessions.begin() as session:
            staged = self.dispatcher.scheduled(session)
        metrics.DISPATCHES.inc(len(staged))
        outbox.flush(self.sessions, self.broker, staged)
        return len(staged)

    # -- periodic --------------------------------------------------------------------------------

    def reconcile(self) -> None:
        self.reconciler.reconcile()

    def publish_far_timers(self) -> None:
        horizon = dt.timedelta(seconds=self.settings.far_timer_horizon_sec)
        far_timers.publish_all_due(self.sessions, self.broker, self.cipher, horizon)

    def relay_outbox(self) -> None:
        relayed = outbox.relay(self.sessions, self.broker, RELAY_AFTER)
        if relayed:
            log.warning("relayed %d outbox row(s) whose publish was lost", relayed)
