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
import os
import socket
import threading
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor

from sqlalchemy import func, select, text, tuple_
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session

from broker import outbox
from broker.client import Broker, connect_when_up
from broker.consumer import Delivery, Quarantine, StreamConsumer, run_until_stopped
from broker.consumers import ConsumerSet
from broker.owners import PostgresOwners
from broker.streams import (
    GROUP_SCHEDULERS,
    CarriedLog,
    Event,
    ForgedEntry,
    MalformedEntry,
    StreamKeys,
    is_wake,
    queue_message,
    read_event,
)
from deferral.authoring.callbacks import (
    REASON_SUCCESS,
    REASON_TASK_FAILURE,
    REASON_TIMED_OUT,
    run_dag_callbacks,
)
from deferral.context import DagRunInfo
from deferral.dag import DAG
from deferral.loading.dagbag import DagBag
from deferral.loading.parsing import FolderParser, Parsed
from deferral.runtime import faults, metrics, serialization
from deferral.runtime.config import Settings
from deferral.runtime.crypto import Cipher
from deferral.runtime.faults import is_transient
from deferral.runtime.process import Every, freeze_startup_objects, log_ids, wait_ms_until_due
from deferral.runtime.serialization import SerializationError
from deferral.states import DagRunState
from deferral.store import (
    hitl,
    liveness,
    partitions,
    pools,
    retention,
    statistics,
    tasklogs,
    transitions,
    waits,
)
from deferral.store.db import make_engine, make_sessionmaker, wait_until_up
from deferral.store.tables import DagRun, Scheduler, TaskInstance
from deferral.store.tasklogs import SOURCE_TRIGGERER, NewLine
from deferral.store.transitions import FiredEvent
from deferral.triggers.task_end import check_end_xcoms
from scheduler import (
    assets,
    dagruns,
    dags,
    deadlines,
    decide,
    end_callbacks,
    far_timers,
    runstate,
    trigger_starts,
    waiting,
)
from scheduler.reconcile import Reconciler
from scheduler.waiting import new_task_instance

log = logging.getLogger("deferral.scheduler")

TI = TaskInstance

EVENT_BATCH = 2000
EVENT_BLOCK_MS = 100
RUN_BATCH = 50
# Queued runs started per transaction: a catch-up or a burst of triggers starts in batches.
START_BATCH = 500
DISPATCH_BATCH = 2000
DISPATCH_PASSES = 8
EXPIRE_EVERY_SEC = 1.0
WAKE_EVERY_SEC = 0.5
RELAY_EVERY_SEC = 5.0
RELAY_AFTER = dt.timedelta(seconds=10)
RECONCILE_EVERY_SEC = 2.0
# Far timers come due within the horizon (minutes): a second's delay is nothing to them.
FAR_TIMERS_EVERY_SEC = 1.0
# Shared trigger rows the unwaited sweep reads per call (going round them all).
UNWAITED_PAGE = 1000
# Runs of DAGs that stopped loading are looked at this often, or twice per grace period if
# that is shorter (at most every 0.5 s): a run fails at most 5 s, or half its grace, after it.
BROKEN_DAGS_EVERY_SEC = 5.0
PRUNE_EVERY_SEC = 3600.0
# The history tables' partitions of the next days are made this often (deferral.store.partitions).
PARTITIONS_EVERY_SEC = 3600.0
# The hot tables' planner statistics are checked this often (deferral.store.statistics).
ANALYZE_EVERY_SEC = 5.0
DEFAULT_MAX_ACTIVE_TASKS = 16
SCHEDULE_RUNS_EVERY_SEC = 1.0
RECOLLECT_MISSING_SEC = 1.0
# The longest a loop waits for the folder read a missing DAG started, as a share of a heartbeat
# (a file written and triggered at once starts in that loop; a slow folder holds no heartbeat).
MISSING_DAG_WAIT_BEATS = 0.4
CHECKED_RUNS_KEPT = 100_000

# The resumed tasks still scheduled (locked; one another scheduler holds is skipped), then their
# runs, locked in id order (as every statement that marks runs locks them), then the names of
# their pools, locked. The runs' queued and running tasks and the pools' free slots are counted
# by the next statements, whose snapshots hold what the locks' last holders queued: counted
# here, before the locks were had, two schedulers resuming tasks of one run each missed the
# other's and overran its max_active_tasks. Rows of kinds rather than a join: the planner
# cannot estimate the locked rows.
_RESUMED_READY_SQL = text(
    """
    WITH ready AS MATERIALIZED (
        SELECT id, dag_id, run_id, pool, pool_slots, priority_weight FROM task_instance
        WHERE id = ANY(CAST(:ids AS bigint[])) AND state = 'scheduled'
        FOR UPDATE SKIP LOCKED
    ), runs AS MATERIALIZED (
        SELECT dag_id, run_id FROM dag_run
        WHERE (dag_id, run_id) IN (SELECT dag_id, run_id FROM ready)
        ORDER BY id
        FOR UPDATE
    ), pools AS ("""
    + pools.LOCK_POOLS_OF_READY
    + """)
    SELECT 'task' AS kind, id, dag_id, run_id, pool, pool_slots, priority_weight FROM ready
    UNION ALL
    SELECT 'run', NULL, dag_id, run_id, NULL, NULL, NULL FROM runs
    UNION ALL
    SELECT 'pool', NULL, NULL, NULL, name, NULL, NULL FROM pools
    """
)

# The queued and running tasks of each of these runs (locked by the statement before), by
# ix_task_instance_run_unfinished.
_RUNS_ACTIVE_SQL = text(
    """
    SELECT t.dag_id, t.run_id, count(*) AS active
    FROM unnest(CAST(:dag_ids AS text[]), CAST(:run_ids AS text[])) AS r (dag_id, run_id)
    JOIN task_instance AS t ON t.dag_id = r.dag_id AND t.run_id = r.run_id
    WHERE t.state IN ('queued', 'running')
    GROUP BY t.dag_id, t.run_id
    """
)

# Which of a loop's passes have anything to do, in one indexed statement (three index probes):
# a loop with nothing to start, evaluate or queue then costs this one round trip instead of
# three transactions, the time an event arriving meanwhile waited for.
# The dispatch pass's statements (:meth:`SchedulerService._dispatch`), plain SQL of a fixed
# shape: built with the ORM (a VALUES list of the pools' room, NOT IN lists that grow with the
# pass) each was compiled again every time, most of the scheduler's CPU while slots free up.
_ANY_SCHEDULED_SQL = text("SELECT id FROM task_instance WHERE state = 'scheduled' LIMIT 1")
_ACTIVE_SQL = text(
    """
    SELECT dag_id, run_id, count(*) AS active FROM task_instance
    WHERE state IN ('queued', 'running') GROUP BY dag_id, run_id
    """
)
# Up to :limit scheduled tasks, highest priority first, of pools with room for them, leaving
# out the full runs and the tasks already chosen.
_DISPATCHABLE_SQL = text(
    """
    SELECT ti.id, ti.dag_id, ti.run_id, ti.pool, ti.pool_slots, ti.priority_weight
    FROM task_instance AS ti
    JOIN unnest(CAST(:pools AS text[]), CAST(:frees AS integer[])) AS room (pool, free)
        ON room.pool = ti.pool AND ti.pool_slots <= room.free
    WHERE ti.state = 'scheduled'
        AND ti.id <> ALL(CAST(:chosen AS bigint[]))
        AND NOT EXISTS (
            SELECT 1 FROM unnest(CAST(:full_dags AS text[]), CAST(:full_runs AS text[]))
                AS f (dag_id, run_id)
            WHERE f.dag_id = ti.dag_id AND f.run_id = ti.run_id
        )
    ORDER BY ti.priority_weight DESC, ti.id
    LIMIT :limit
    FOR UPDATE OF ti SKIP LOCKED
    """
)
_DEFERRED_BY_CLASS_SQL = text(
    """
    SELECT t.classpath, count(*) FROM task_instance ti JOIN trigger t ON t.id = ti.trigger_id
    WHERE ti.state = 'deferred' GROUP BY t.classpath
    """
)
# Runs marked for evaluation, counted up to :most (ix_dag_run_evaluate_after): how far the
# evaluation pass is behind the start pass.
_MARKED_BACKLOG_SQL = text(
    """
    SELECT count(*) FROM (
        SELECT 1 FROM dag_run WHERE evaluate_after <= now() AND state = 'running' LIMIT :most
    ) AS marked
    """
)
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
        # An event batch read but not yet recorded because the servers failed: retried first.
        self.unapplied: list[Delivery] = []
        # DAG callbacks run in these threads; runs finished in the current evaluation pass.
        self.callbacks = ThreadPoolExecutor(max_workers=2, thread_name_prefix="dag-callbacks")
        self._finished: list[tuple[DAG, DagRun, bool, str]] = []
        self._scheduled: list[int] = []  # task instances the current evaluation pass scheduled
        # Trigger entries of the tasks it started in the triggerer (a run whose evaluation is
        # rolled back leaves an entry whose trigger no task waits on: its triggerer drops it).
        self._started_staged: list[outbox.Staged] = []
        # Run id -> the DAG object the run was last found to have every task of.
        self._checked: dict[int, DAG] = {}
        # What the current evaluation pass found, remembered only once it commits: a pass (or
        # a run's savepoint) rolled back also undid the task instances it added.
        self._checked_now: dict[int, DAG] = {}
        # Where the sweep for unwaited shared triggers goes on (a trigger id; 0: the first).
        self._unwaited_after = 0
        self.broker: Broker
        self.consumer: ConsumerSet
        self.reconciler: Reconciler
        beat = settings.heartbeat_sec
        broken_every = min(BROKEN_DAGS_EVERY_SEC, max(settings.dag_import_grace_sec / 2, 0.5))
        self.periodic = [
            Every(settings.dag_refresh_sec, self.parser.start),
            Every(beat, self._renew),
            Every(beat, self.heartbeat),
            Every(beat / 4, self._take_over),
            Every(EXPIRE_EVERY_SEC, self.expire_deferrals),
            Every(EXPIRE_EVERY_SEC, self.fire_wait_timers),
            Every(EXPIRE_EVERY_SEC, self.expire_input_requests),
            Every(EXPIRE_EVERY_SEC, self.record_deadline_misses),
            Every(WAKE_EVERY_SEC, self.wake_due),
            Every(RELAY_EVERY_SEC, self.relay_outbox),
            Every(RECONCILE_EVERY_SEC, self.reconcile),
            Every(FAR_TIMERS_EVERY_SEC, self.publish_far_timers),
            Every(broken_every, self.fail_broken_runs),
            Every(PRUNE_EVERY_SEC, self.prune),
            Every(PARTITIONS_EVERY_SEC, self.make_partitions),
            Every(ANALYZE_EVERY_SEC, self.analyze_changed_tables),
            Every(SCHEDULE_RUNS_EVERY_SEC, self.schedule_runs),
        ]

    def run(self, stop: threading.Event) -> None:
        broker = connect_when_up(
            self.settings.redis_url, self.settings.stream_prefix, stop, self.settings.stream_shards
        )
        if broker is None or not wait_until_up(self.engine, stop):
            return
        self.attach(broker)
        if not run_until_stopped(stop, self.consumer.start, recover=lambda: None, once=True):
            return
        freeze_startup_objects()
        log.info("scheduler %s started", self.name)
        run_until_stopped(stop, self.step, recover=self.consumer.start)
        self.parser.close()
        try:
            self.heartbeat(liveness.STOPPED)
        except SQLAlchemyError as exc:
            log.warning("could not record the scheduler as stopped: %s", exc)
        self.callbacks.shutdown(wait=True)
        self.broker.close()
        log.info("scheduler %s stopped", self.name)

    def attach(self, broker: Broker) -> None:
        """Use ``broker`` (connected) for the streams."""
        self.broker = broker
        self.quarantine = Quarantine()  # one per process, over all its streams
        self.consumer = ConsumerSet(self._consumer_of, self.keys.all_events)
        self.reconciler = Reconciler(
            self.sessions, broker, self.cipher, self.settings.heartbeat_sec
        )
        metrics.STREAMS.watch(broker.stream_stats)
        metrics.DEFERRED.watch(self._deferred_by_trigger_class)

    def _consumer_of(self, stream: str) -> StreamConsumer:
        """The consumer of one events stream (a shard's)."""
        return StreamConsumer(
            self.broker,
            stream,
            GROUP_SCHEDULERS,
            self.name,
            heartbeat_sec=self.settings.heartbeat_sec,
            max_deliveries=self.settings.max_deliveries,
            cipher=self.cipher,
            dead_letter_maxlen=self.settings.dead_letter_maxlen,
            owners=PostgresOwners(self.sessions, Scheduler),
            quarantine=self.quarantine,
        )

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
        self.apply_events(
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
            dagruns.sync_dags(session, parsed, dt.datetime.now(dt.UTC), parsed.pending)
            back = dags.sync(session, parsed, parsed.pending)
            assets.sync_assets(session, parsed.dags, self.cipher)
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
                [(run, [new_task_instance(run, t) for t in dag.tasks]) for run, dag in started],
            )
        for run, dag in started:
            self._remember_checked(run.id, dag)
        if started:
            said = ", ".join(run.run_id for run, _ in started[:5])
            more = f" and {len(started) - 5} more" if len(started) > 5 else ""
            dag_ids = ", ".join(sorted({run.dag_id for run, _ in started}))
            log.info("started %d run(s) of %s: %s%s", len(started), dag_ids, said, more)

    def evaluate_marked_runs(self) -> None:
        """Decide what may move on in each run marked since its last evaluation."""
        with self.sessions.begin() as session:
            runs = session.scalars(
                select(DagRun)
                .where(DagRun.evaluate_after <= func.now(), DagRun.state == DagRunState.RUNNING)
                .order_by(DagRun.evaluate_after)
                .limit(RUN_BATCH)
                .with_for_update(skip_locked=True)
            ).all()
            if not runs:
                return
            # A run in which nothing can be decided (its tasks run or wait on triggers) costs
            # three index probes, whatever its size: a run of 10,000 tasks is marked by each
            # success (scheduler/DECISIONS.md 12).
            probed = runstate.probes(session, [(run.dag_id, run.run_id) for run in runs])
            self._finished, self._scheduled, self._checked_now = [], [], {}
            self._started_staged = []
            for run in runs:
                dag = self._dag(run.dag_id)
                probes = probed.get((run.dag_id, run.run_id), decide.RunProbes(False, False, False))
                if dag is not None and not decide.needs_evaluation(
                    probes, checked_against_dag=self._checked.get(run.id) is dag
                ):
                    transitions.evaluated(session, run)
                    continue
                try:
                    with session.begin_nested():
                        self._evaluate(session, run, probes)
                except Exception as exc:
                    if is_transient(exc):
                        raise
                    # One run that raises must not stop the others: say why, look again later.
                    log.exception("evaluating run %s of DAG %s failed", run.run_id, run.dag_id)
                    transitions.evaluated(session, run, error=f"{type(exc).__name__}: {exc}")
                    self._checked_now.pop(run.id, None)
            # A run's depends_on_past tasks wait on the run before: what changed here may let
            # the next runs' go (no transition marks them, this pass does).
            for run in runs:
                dag = self._dag(run.dag_id)
                if dag is not None:
                    runstate.mark_next_runs(session, dag, run)
            # Tasks that became ready are queued in this transaction, as resumed tasks are (the
            # same decision: pools, priorities, max_active_tasks), not by a later dispatch pass.
            staged = self._dispatch_resumed(session, self._scheduled) + self._started_staged
        for run_pk, checked in self._checked_now.items():
            self._remember_checked(run_pk, checked)
        self._call_back(self._finished)
        metrics.DISPATCHES.inc(len(staged))
        outbox.flush(self.sessions, self.broker, staged)

    def _call_back(self, finished: Sequence[tuple[DAG, DagRun, bool, str]]) -> None:
        """Run the DAG callbacks of runs that finished (and committed), off the loop: they are
        user code, and the loop must not wait on them."""
        for dag, run, success, reason in finished:
            if (dag.on_success_callback if success else dag.on_failure_callback) is None:
                continue
            info = DagRunInfo.of(run)
            self.callbacks.submit(run_dag_callbacks, dag, info, success=success, reason=reason)

    def _evaluate(self, session: Session, run: DagRun, probes: decide.RunProbes) -> None:
        dag = self._dag(run.dag_id)
        if dag is None:
            # Its DAG does not load (now): fail_broken_runs decides after the grace period, and
            # the run is looked at again when the DAG loads again.
            transitions.evaluated(session, run)
            return
        moved = 0
        if self._checked.get(run.id) is not dag:
            # Tasks added to the DAG file after the run started join the run, as in Airflow;
            # checked once per run and DAG object (the DagBag keeps the object of an unchanged
            # file), not on every change.
            missing = runstate.missing_tasks(session, run.dag_id, run.run_id, dag.task_dict)
            added = [new_task_instance(run, dag.task_dict[task_id]) for task_id in missing]
            if added:
                transitions.add_task_instances(session, run, added)
                moved += len(added)
            self._checked_now[run.id] = dag
        if probes.waiting or probes.retries_undue or moved:
            advanced = waiting.advance_run(session, run, dag, self.settings.max_map_length)
            moved += advanced.moved
            # start_from_trigger tasks go to the triggerer now, not to the pools' queue.
            started, staged = trigger_starts.start_in_triggerer(
                session, dag, advanced.scheduled, self.cipher, self.keys
            )
            self._started_staged += staged
            self._scheduled += [ti for ti in advanced.scheduled if ti not in started]
        outcome = None
        if moved or not probes.unfinished:
            unfinished, leaf_failed = runstate.outcome_probes(session, dag, run.dag_id, run.run_id)
            outcome = decide.run_outcome(unfinished=unfinished, leaf_failed=leaf_failed)
        if outcome is not None:
            transitions.finish_dag_run(session, run, outcome)
            self._checked.pop(run.id, None)
            self._checked_now.pop(run.id, None)
            log.info("run %s of DAG %s finished: %s", run.run_id, run.dag_id, outcome)
            success = outcome == DagRunState.SUCCESS
            self._finished.append(
                (dag, run, success, REASON_SUCCESS if success else REASON_TASK_FAILURE)
            )
        else:
            transitions.evaluated(session, run)

    def _remember_checked(self, run_pk: int, dag: DAG) -> None:
        """Remember that run ``run_pk`` has a task instance of every task of ``dag``."""
        if len(self._checked) >= CHECKED_RUNS_KEPT:
            self._checked.clear()  # runs finished elsewhere leave entries: start again
        self._checked[run_pk] = dag

    # -- dispatch: scheduled -> queued -----------------------------------------------------------

    def dispatch_scheduled(self) -> int:
        """Queue scheduled tasks (of any run) that pools and run budgets let through; returns
        how many."""
        with self.sessions.begin() as session:
            staged = self._dispatch(session)
        metrics.DISPATCHES.inc(len(staged))
        outbox.flush(self.sessions, self.broker, staged)
        return len(staged)

    def _dispatch(self, session: Session) -> list[outbox.Staged]:
        """scheduled -> queued for the scheduled tasks (of any run) that their pool and their
        run's max_active_tasks allow, highest priority first; returns the outbox rows of their
        queue entries.

        As Airflow does, what cannot go is left out of the query rather than read and skipped
        (:meth:`_dispatchable`), and no more tasks are read than the pools have slots: a backlog
        of scheduled tasks behind full pools costs a loop nothing but a count."""
        if session.scalar(_ANY_SCHEDULED_SQL) is None:
            return []
        pool_free = pools.free_slots(session)
        active = {(row.dag_id, row.run_id): row.active for row in session.execute(_ACTIVE_SQL)}
        budget = {
            run: decide.dispatch_budget(self._max_active_tasks(run[0]), count)
            for run, count in active.items()
        }
        chosen: list[int] = []
        # Each pass queues at least the first task it reads; a run that one pass fills is left
        # out of the next, so runs of small max_active_tasks do not hold the pools' room back.
        for _ in range(DISPATCH_PASSES):
            room = {name: free for name, free in pool_free.items() if free > 0}
            limit = min(DISPATCH_BATCH - len(chosen), sum(room.values()))
            if limit <= 0:
                break
            full = [run for run, left in budget.items() if left <= 0]
            ready = self._dispatchable(session, room, full, chosen, limit)
            for task in ready:
                if task.run not in budget:
                    budget[task.run] = self._max_active_tasks(task.run[0])
            plan = decide.plan_dispatch(ready, budget, pool_free)
            chosen += plan.chosen
            pool_free, budget = plan.pool_free, plan.run_budget
            if len(ready) < limit:
                break  # read every task that could go
        return self._queue(session, chosen)

    def _dispatch_resumed(self, session: Session, ids: Sequence[int]) -> list[outbox.Staged]:
        """:meth:`_dispatch` for the tasks just resumed (``ids``), in the transaction that
        resumed them: their rows with their runs' active counts, their pools' free slots, the
        move. Plain SQL, a fixed number of statements: this is on every resume's path."""
        if not ids:
            return []
        ready: list[decide.Ready] = []
        for row in session.execute(_RESUMED_READY_SQL, {"ids": list(ids)}):
            # The other kinds of rows are the runs and pools it locked.
            if row.kind == "task":
                run = (row.dag_id, row.run_id)
                ready.append(
                    decide.Ready(row.id, run, row.pool, row.pool_slots, row.priority_weight)
                )
        if not ready:
            return []
        runs = sorted({task.run for task in ready})
        params = {"dag_ids": [r[0] for r in runs], "run_ids": [r[1] for r in runs]}
        active: dict[decide.RunKey, int] = {
            (row.dag_id, row.run_id): row.active
            for row in session.execute(_RUNS_ACTIVE_SQL, params)
        }
        budget = {
            task.run: decide.dispatch_budget(
                self._max_active_tasks(task.run[0]), active.get(task.run, 0)
            )
            for task in ready
        }
        pool_free = pools.free_slots(session, {task.pool for task in ready}, locked=True)
        return self._queue(session, decide.choose_dispatch(ready, budget, pool_free))

    def _queue(self, session: Session, chosen: Sequence[int]) -> list[outbox.Staged]:
        """Move the ``chosen`` tasks to queued and stage their queue entries."""
        if not chosen:
            return []
        messages = [
            (
                self.keys.queue(row.queue),
                queue_message(
                    self.cipher,
                    row.id,
                    row.try_number,
                    row.dag_id,
                    row.run_id,
                    row.task_id,
                    row.map_index,
                ),
            )
            for row in transitions.dispatch(session, chosen)
        ]
        return outbox.stage_many(session, messages)

    @staticmethod
    def _dispatchable(
        session: Session,
        room: Mapping[str, int],
        full: Sequence[decide.RunKey],
        chosen: Sequence[int],
        limit: int,
    ) -> list[decide.Ready]:
        """Up to ``limit`` scheduled tasks, highest priority first, leaving out what cannot go:
        tasks of pools without ``room`` for them, of ``full`` runs, and those already
        ``chosen``; so the first one read can always go."""
        params = {
            "pools": sorted(room),
            "frees": [room[name] for name in sorted(room)],
            "full_dags": [run[0] for run in full],
            "full_runs": [run[1] for run in full],
            "chosen": list(chosen),
            "limit": limit,
        }
        return [
            decide.Ready(
                row.id, (row.dag_id, row.run_id), row.pool, row.pool_slots, row.priority_weight
            )
            for row in session.execute(_DISPATCHABLE_SQL, params)
        ]

    def _max_active_tasks(self, dag_id: str) -> int:
        dag = self._dag(dag_id)
        return DEFAULT_MAX_ACTIVE_TASKS if dag is None else dag.max_active_tasks

    # -- events: deferred -> scheduled (-> queued) -----------------------------------------------

    def apply_events(self, block_ms: int | None) -> int:
        """Apply a batch of events, queue the tasks they resumed where pools and budgets allow,
        and only then acknowledge them (after commit)."""
        deliveries = self.unapplied or self.consumer.poll(EVENT_BATCH, block_ms=block_ms)
        wakes = [d.entry for d in deliveries if is_wake(d.entry.fields)]
        deliveries = [d for d in deliveries if not is_wake(d.entry.fields)]
        # Kept before the wakes are retired: events read with a wake whose retirement fails
        # would otherwise stay held and renewed here, never applied.
        self.unapplied = list(deliveries)
        if wakes:
            # A worker recorded outcomes: the loop that follows evaluates the marked runs and
            # queues into the freed slots at once (what to do is read from Postgres; the entry
            # carries nothing more).
            try:
                self.consumer.retire(wakes)
            except Exception:
                # No longer renewed: taken over and retired after the takeover delay.
                self.consumer.release([entry.id for entry in wakes])
                raise
        if not deliveries:
            return 0
        faults.inject("scheduler.events_read")
        unreadable: list[tuple[Delivery, str]] = []
        parsed = [
            (d, event) for d in deliveries if (event := self._parse(d, unreadable)) is not None
        ]
        self.consumer.dead_letter_many(unreadable)
        try:
            applied, poisoned, staged = self._apply(parsed, one_by_one=False)
        except Exception as exc:
            if is_transient(exc):
                raise
            # Some row cannot be applied: apply one by one, so it alone is dead-lettered.
            log.exception("applying %d events together failed; one by one now", len(parsed))
            applied, poisoned, staged = self._apply(parsed, one_by_one=True)
        self.unapplied = []
        committed = time.time()
        # Published before anything else: the queued tasks' workers wait for these entries.
        metrics.DISPATCHES.inc(len(staged))
        outbox.flush(self.sessions, self.broker, staged)
        outcomes: Counter[str] = Counter()
        for delivery, event, result in applied:
            # Every resume is in task_state_change; a line each only for what did not resume.
            log.log(
                logging.DEBUG if result.outcome == "applied" else logging.INFO,
                "event %s for trigger %d: %s",
                event.dedup_key,
                event.trigger_id,
                result.outcome,
            )
            outcomes[result.outcome] += 1
            if result.task_instance_id is not None:
                metrics.RESUME_LATENCY.observe(max(0.0, committed - delivery.entry.added_at))
        for outcome, count in outcomes.items():
            metrics.EVENTS.labels(outcome).inc(count)
        if applied:
            said = ", ".join(f"{count} {outcome}" for outcome, count in sorted(outcomes.items()))
            log.info("%d event(s): %s; %d task(s) queued", len(applied), said, len(staged))
        ended = [ti for _, _, r in applied if r.outcome == "ended" for ti in r.ids()]
        end_callbacks.call_back_ended(self.sessions, self.callbacks, self._dag, ended)
        self.consumer.retire([d.entry for d, _, _ in applied])
        self.consumer.dead_letter_many(poisoned)
        return len(applied)

    def _apply(
        self, parsed: list[tuple[Delivery, FiredEvent]], *, one_by_one: bool
    ) -> tuple[
        list[tuple[Delivery, FiredEvent, transitions.Resumed]],
        list[tuple[Delivery, str]],
        list[outbox.Staged],
    ]:
        """Resume the events' tasks and queue those that can go, in one transaction (no
        savepoint: a batch that fails on bad data is rolled back whole and applied again one by
        one)."""
        poisoned: list[tuple[Delivery, str]] = []
        with self.sessions.begin() as session:
            faults.inject("scheduler.apply_events")
            if one_by_one:
                applied, poisoned = self._apply_one_by_one(session, parsed)
            else:
                resumed = transitions.resume_many(session, [e for _, e in parsed], self.cipher)
                applied = [(d, e, r) for (d, e), r in zip(parsed, resumed, strict=True)]
            resumed_ids = [r.task_instance_id for _, _, r in applied if r.task_instance_id]
            resumed_ids += [other for _, _, r in applied for other in r.others]
            staged = self._dispatch_resumed(session, resumed_ids)
            # The triggerer's lines about what fired, in this transaction: before anything the
            # resumed attempts write (a duplicate's lines were stored with the first).
            lines = [line for _, e, r in applied if r.outcome != "duplicate" for line in e.log]
            tasklogs.append(session, lines, self.settings.task_log_max_bytes)
        return applied, poisoned, staged

    def _apply_one_by_one(
        self, session: Session, parsed: list[tuple[Delivery, FiredEvent]]
    ) -> tuple[list[tuple[Delivery, FiredEvent, transitions.Resumed]], list[tuple[Delivery, str]]]:
        applied, poisoned = [], []
        for delivery, event in parsed:
            try:
                with session.begin_nested():
                    applied.append(
                        (delivery, event, transitions.resume(session, event, self.cipher))
                    )
            except Exception as exc:
                if is_transient(exc):
                    raise
                log.exception(
                    "cannot apply event %s",
                    event.dedup_key,
                    extra=log_ids(trigger_id=event.trigger_id),
                )
                poisoned.append((delivery, f"cannot apply event: {exc!r}"))
        return applied, poisoned

    def _parse(
        self, delivery: Delivery, unreadable: list[tuple[Delivery, str]]
    ) -> FiredEvent | None:
        """The event an entry carries; a bad entry goes to ``unreadable`` with the reason (to
        be dead-lettered) and changes nothing."""
        try:
            event: Event = read_event(self.cipher, delivery.entry.fields)
        except (MalformedEntry, ForgedEntry) as exc:
            unreadable.append((delivery, f"bad event entry: {exc}"))
            return None
        except Exception as exc:  # unforeseen bad data: it alone is set aside, not the loop
            unreadable.append((delivery, f"unreadable event entry: {type(exc).__name__}: {exc}"))
            return None
        if self.consumer.exhausted(delivery):
            # It killed every scheduler that read it: resume its task at __fail__ instead.
            reason = f"event {event.dedup_key} {self.consumer.exhausted_reason(delivery)}"
            log.error("%s", reason)
            return FiredEvent(event.dedup_key, event.trigger_id, True, {"message": reason})
        try:
            payload = serialization.loads(event.payload)
        except SerializationError as exc:
            # The task must not wait forever on an event nobody can read: fail it, saying why.
            message = f"trigger {event.trigger_id} sent an unreadable event: {exc}"
            return FiredEvent(event.dedup_key, event.trigger_id, True, {"message": message})
        if event.ends:
            try:
                check_end_xcoms(payload)
            except ValueError as exc:
                message = f"trigger {event.trigger_id} sent a bad task-end event: {exc}"
                return FiredEvent(event.dedup_key, event.trigger_id, True, {"message": message})
        return FiredEvent(
            event.dedup_key,
            event.trigger_id,
            event.failed,
            payload,
            _carried_lines(event.log),
            event.sealed_payload or None,  # stored as it is: it was just read, so it opens
            ends=event.ends or None,
        )

    def _renew(self) -> None:
        self.consumer.renew()

    def heartbeat(self, state: str = liveness.RUNNING) -> None:
        """Refresh this scheduler's row, which ``deferral health`` reads."""
        values = {"name": self.name, "hostname": socket.gethostname(), "pid": os.getpid()}
        with self.sessions.begin() as session:
            liveness.heartbeat(session, Scheduler, {**values, "state": state})

    def _take_over(self) -> None:
        if not self.unapplied:
            self.unapplied = self.consumer.claim(EVENT_BATCH)

    # -- periodic --------------------------------------------------------------------------------

    def _deferred_by_trigger_class(self) -> dict[str, int]:
        """Deferred tasks by their trigger's class, for a scrape (on the metrics thread)."""
        with self.sessions.begin() as session:
            session.execute(text("SET LOCAL statement_timeout = '5s'"))
            rows = session.execute(_DEFERRED_BY_CLASS_SQL).all()
        return {classpath: count for classpath, count in rows}

    def expire_deferrals(self) -> None:
        with self.sessions.begin() as session:
            expired = transitions.expire_deferrals(session, self.cipher)
        metrics.TRIGGER_TIMEOUTS.inc(len(expired))
        metrics.DEFERRAL_TIMEOUTS.inc(len(expired))
        if expired:
            log.info("deferral timed out for task instance(s) %s", expired)
        # Shared triggers whose last waiter left (timed out, cleared, marked), a page per call
        # in a transaction of its own.
        with self.sessions.begin() as session:
            dropped, self._unwaited_after = transitions.drop_unwaited(
                session, self._unwaited_after, UNWAITED_PAGE
            )
        if dropped:
            log.info("shared trigger(s) %s dropped: their last waiter left", dropped)

    def fire_wait_timers(self) -> None:
        """Composite waits whose timer is due (deferral.store.waits): a page per call."""
        with self.sessions.begin() as session:
            fired = waits.fire_due_timers(session, self.cipher)
        if fired:
            log.info("wait timer fired for task instance(s) %s", fired)

    def expire_input_requests(self) -> None:
        """Tasks awaiting input whose response timeout passed: their defaults, or a failure."""
        with self.sessions.begin() as session:
            expired = hitl.expire(session, self.cipher)
        metrics.HITL_TIMEOUTS.inc(len(expired))
        if expired:
            log.info("response timeout passed for task instance(s) %s", expired)

    def record_deadline_misses(self) -> None:
        """Runs past a DeadlineAlert's deadline: recorded once, their callbacks run off the loop."""
        with self.sessions.begin() as session:
            missed = deadlines.record_misses(session, self.dags, dt.datetime.now(dt.UTC))
        metrics.DEADLINE_MISSES.inc(len(missed))
        if missed:
            log.warning("deadline missed by %s", [m.context["run_id"] for m in missed])
            self.callbacks.submit(deadlines.call_back, self.sessions, missed)

    def wake_due(self) -> None:
        with self.sessions.begin() as session:
            transitions.wake_due(session)

    def reconcile(self) -> None:
        self.reconciler.reconcile()

    def publish_far_timers(self) -> None:
        horizon = dt.timedelta(seconds=self.settings.far_timer_horizon_sec)
        far_timers.publish_all_due(self.sessions, self.broker, self.cipher, horizon)

    def relay_outbox(self) -> None:
        relayed = outbox.relay(self.sessions, self.broker, RELAY_AFTER)
        if relayed:
            log.warning("relayed %d outbox row(s) whose publish was lost", relayed)

    def prune(self) -> None:
        if self.settings.prune_older_than is None:
            return
        pruned = retention.prune(self.sessions, self.settings.prune_older_than)
        if pruned.total:
            log.info("%s", pruned.describe())

    def analyze_changed_tables(self) -> None:
        """ANALYZE a hot table after bulk changes, so that plans follow what the tables hold,
        and vacuum the run counts after many folds."""
        analyzed = statistics.analyze_changed(self.sessions)
        if analyzed:
            log.info("analyzed %s after bulk changes", analyzed)
        if statistics.vacuum_counts(self.engine):
            log.info("vacuumed dag_run_count: its folds left more dead rows than live ones")

    def make_partitions(self) -> None:
        made = partitions.make_ahead(self.sessions)
        if made:
            log.info("made history partition(s) %s", ", ".join(made))


def _carried_lines(log: CarriedLog | None) -> tuple[NewLine, ...]:
    if log is None:
        return ()
    ti, try_number = log.task_instance_id, log.try_number
    return tuple(
        NewLine(ti, try_number, dt.datetime.fromtimestamp(at, dt.UTC), SOURCE_TRIGGERER, line)
        for at, line in log.lines
    )
