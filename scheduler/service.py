"""``scheduler consume``: starts DAG runs, schedules and dispatches tasks, applies trigger events
(deferred -> scheduled), expires deferrals, relays the outbox and finishes DAG runs.

Several replicas may run: a DAG run is advanced under ``SELECT ... FOR UPDATE SKIP LOCKED`` by one
replica at a time, and events are applied as dedup-keyed conditional updates.
"""

from __future__ import annotations

import datetime as dt
import logging
import threading
from collections.abc import Sequence

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from broker import outbox
from broker.client import Broker, run_until_stopped
from broker.replies import Entry
from broker.streams import (
    EVENT_KIND_EVENT,
    EVENT_KIND_FAILURE,
    GROUP_SCHEDULERS,
    EventMessage,
    MalformedEntry,
    from_fields,
    queue_message,
)
from deferral import pools, serialization, transitions
from deferral.baseoperator import BaseOperator
from deferral.config import Settings
from deferral.crypto import Cipher
from deferral.dag import DAG
from deferral.dagbag import DagBag, DagNotFound
from deferral.db import make_engine, make_sessionmaker
from deferral.models import DagRun, Outbox, TaskInstance, TaskReschedule
from deferral.process import Every
from deferral.serialization import SerializationError
from deferral.states import DagRunState, TaskState
from deferral.transitions import FiredEvent, NewTaskInstance
from scheduler import decide, reconcile

log = logging.getLogger("deferral.scheduler")

EVENT_BATCH = 200
EVENT_BLOCK_MS = 200
EXPIRE_EVERY_SEC = 1.0
RELAY_EVERY_SEC = 5.0
RELAY_AFTER = dt.timedelta(seconds=10)
DAGBAG_REFRESH_SEC = 10.0
RECONCILE_EVERY_SEC = 5.0


class SchedulerService:
    def __init__(self, settings: Settings, *, name: str) -> None:
        self.name = name
        self.cipher = Cipher(settings.fernet_keys)
        self.sessions = make_sessionmaker(make_engine(settings.database_url))
        self.broker = Broker.from_url(settings.redis_url, settings.stream_prefix)
        self.dagbag = DagBag(settings.dags_folder)
        self._warned_no_pool: set[int] = set()
        self._warned_no_dag: set[int] = set()
        self.periodic = [
            Every(DAGBAG_REFRESH_SEC, self._refresh_dags),
            Every(EXPIRE_EVERY_SEC, self.expire_deferrals),
            Every(RELAY_EVERY_SEC, self.relay_outbox),
            Every(RECONCILE_EVERY_SEC, self.reconcile),
        ]

    def run(self, stop: threading.Event) -> None:
        self.broker.ensure_group(self.broker.keys.events, GROUP_SCHEDULERS)
        log.info("scheduler %s started", self.name)
        run_until_stopped(self.broker, stop, self.step, self.broker.keys.events, GROUP_SCHEDULERS)
        self.broker.close()
        log.info("scheduler %s stopped", self.name)

    def step(self) -> None:
        for periodic in self.periodic:
            periodic()
        self.start_queued_runs()
        self.advance_running_runs()
        self.apply_events(block_ms=EVENT_BLOCK_MS)

    def _refresh_dags(self) -> None:
        self.dagbag.collect()
        for path, error in self.dagbag.import_errors.items():
            log.error("DAG file %s: %s", path, error)

    def _dag(self, dag_id: str) -> DAG | None:
        try:
            return self.dagbag.get_dag(dag_id)
        except DagNotFound:
            return None

    # -- DAG runs --------------------------------------------------------------------------------

    def start_queued_runs(self) -> None:
        with self.sessions.begin() as session:
            runs = session.scalars(
                select(DagRun)
                .where(DagRun.state == DagRunState.QUEUED)
                .order_by(DagRun.id)
                .limit(50)
                .with_for_update(skip_locked=True)
            ).all()
            for run in runs:
                dag = self._dag(run.dag_id)
                if dag is None:
                    log.error("run %s of DAG %r failed: DAG not found", run.run_id, run.dag_id)
                    transitions.finish_dag_run(session, run, DagRunState.FAILED)
                    continue
                transitions.start_dag_run(session, run, [_new_ti(t) for t in dag.tasks])
                log.info("started run %s of DAG %s", run.run_id, run.dag_id)

    def advance_running_runs(self) -> None:
        with self.sessions() as session:
            run_ids = session.scalars(
                select(DagRun.id).where(DagRun.state == DagRunState.RUNNING).order_by(DagRun.id)
            ).all()
        for run_id in run_ids:
            staged: list[Outbox] = []
            with self.sessions.begin() as session:
                run = session.scalars(
                    select(DagRun).where(DagRun.id == run_id).with_for_update(skip_locked=True)
                ).one_or_none()
                if run is not None and run.state == DagRunState.RUNNING:
                    staged = self._advance(session, run)
            outbox.flush(self.sessions, self.broker, staged)

    def _advance(self, session: Session, run: DagRun) -> list[Outbox]:
        dag = self._dag(run.dag_id)
        if dag is None:
            if run.id not in self._warned_no_dag:  # once per run, not on every loop
                self._warned_no_dag.add(run.id)
                log.error(
                    "run %s of DAG %r: DAG not found, cannot advance it", run.run_id, run.dag_id
                )
            return []
        self._warned_no_dag.discard(run.id)
        tis = self._task_instances(session, run)
        added = [_new_ti(t) for t in dag.tasks if t.task_id not in {ti.task_id for ti in tis}]
        if added:
            # Tasks added to the DAG file after the run started join the run, as in Airflow.
            transitions.add_task_instances(session, run, added)
            tis = self._task_instances(session, run)
        by_task = {ti.task_id: ti for ti in tis}
        states = {ti.task_id: ti.state for ti in tis}

        decisions = decide.waiting_task_decisions(dag, states)
        for to_state in (TaskState.SCHEDULED, TaskState.SKIPPED, TaskState.UPSTREAM_FAILED):
            ids = [by_task[t].id for t, s in decisions.items() if s == to_state]
            if to_state == TaskState.SCHEDULED:
                transitions.schedule(session, ids)
            else:
                transitions.never_run(session, ids, to_state, "trigger rule")
        states.update(decisions)

        now = dt.datetime.now(dt.UTC)
        due = [
            ti.id
            for ti in tis
            if ti.state == TaskState.UP_FOR_RETRY
            and ti.task_id in dag.task_dict
            and decide.retry_due(now, ti.end_date, dag.task_dict[ti.task_id].retry_delay)
        ]
        for ti_id in transitions.retry(session, due):
            states[_task_of(tis, ti_id)] = TaskState.SCHEDULED
        for ti_id in transitions.poke_again(session, self._reschedules_due(session, tis, now)):
            states[_task_of(tis, ti_id)] = TaskState.SCHEDULED

        staged = self._dispatch(session, run, dag, tis, states)

        outcome = decide.dag_run_outcome(dag, states)
        if outcome is not None:
            transitions.finish_dag_run(session, run, outcome)
            log.info("run %s of DAG %s finished: %s", run.run_id, run.dag_id, outcome)
        return staged

    @staticmethod
    def _reschedules_due(
        session: Session, tis: Sequence[TaskInstance], now: dt.datetime
    ) -> list[int]:
        waiting = [ti.id for ti in tis if ti.state == TaskState.UP_FOR_RESCHEDULE]
        if not waiting:
            return []
        latest = session.execute(
            select(TaskReschedule.task_instance_id, func.max(TaskReschedule.reschedule_date))
            .where(TaskReschedule.task_instance_id.in_(waiting))
            .group_by(TaskReschedule.task_instance_id)
        ).all()
        return [ti_id for ti_id, when in latest if decide.reschedule_due(now, when)]

    @staticmethod
    def _task_instances(session: Session, run: DagRun) -> Sequence[TaskInstance]:
        return session.scalars(
            select(TaskInstance).where(
                TaskInstance.dag_id == run.dag_id, TaskInstance.run_id == run.run_id
            )
        ).all()

    def _dispatch(
        self,
        session: Session,
        run: DagRun,
        dag: DAG,
        tis: Sequence[TaskInstance],
        states: dict[str, str],
    ) -> list[Outbox]:
        ready = [
            decide.Ready(ti.id, ti.pool, ti.pool_slots, ti.priority_weight)
            for ti in tis
            if states[ti.task_id] == TaskState.SCHEDULED
        ]
        if not ready:
            return []
        pool_free = pools.free_slots(session, {task.pool for task in ready})
        for task in ready:
            if task.pool not in pool_free and task.id not in self._warned_no_pool:
                self._warned_no_pool.add(task.id)
                log.warning(
                    "run %s: task instance %d waits for pool %r, which does not exist",
                    run.run_id,
                    task.id,
                    task.pool,
                )
        budget = decide.dispatch_budget(dag.max_active_tasks, states)
        chosen = decide.choose_dispatch(ready, budget, pool_free)
        staged = []
        for row in transitions.dispatch(session, chosen):
            states[row.task_id] = TaskState.QUEUED
            message = queue_message(
                row.id, row.try_number, row.dag_id, row.run_id, row.task_id, row.map_index
            )
            staged.append(outbox.stage(session, self.broker.keys.queue(row.queue), message))
        session.flush()
        return staged

    # -- events: deferred -> scheduled -------------------------------------------------------------

    def apply_events(self, block_ms: int | None) -> int:
        stream = self.broker.keys.events
        entries = self.broker.read(
            GROUP_SCHEDULERS, self.name, {stream: ">"}, count=EVENT_BATCH, block_ms=block_ms
        )
        if not entries:
            return 0
        parsed = [(entry, event) for entry in entries if (event := self._parse_event(entry))]
        done: list[str] = []
        poisoned: list[tuple[Entry, str]] = []
        with self.sessions.begin() as session:
            try:
                with session.begin_nested():
                    events = [event for _, event in parsed]
                    outcomes = transitions.resume_many(session, events, self.cipher)
                applied = list(zip(parsed, outcomes, strict=True))
            except Exception:
                # Some row cannot be applied: apply one by one, so it alone is dead-lettered.
                log.exception("applying %d events together failed; one by one now", len(parsed))
                applied, poisoned = self._apply_one_by_one(session, parsed)
            for (entry, event), outcome in applied:
                log.info("event %s for trigger %d: %s", event.dedup_key, event.trigger_id, outcome)
                done.append(entry.id)
        # Acknowledge only after commit: an event is never lost between Redis and Postgres.
        self.broker.ack_delete(stream, GROUP_SCHEDULERS, done)
        for entry, error in poisoned:
            self.broker.dead_letter(entry, GROUP_SCHEDULERS, error)
        return len(done)

    def _apply_one_by_one(
        self, session: Session, parsed: list[tuple[Entry, FiredEvent]]
    ) -> tuple[list[tuple[tuple[Entry, FiredEvent], str]], list[tuple[Entry, str]]]:
        applied, poisoned = [], []
        for entry, event in parsed:
            try:
                with session.begin_nested():
                    applied.append(
                        ((entry, event), transitions.resume(session, event, self.cipher))
                    )
            except Exception as exc:
                log.exception("cannot apply event %s", event.dedup_key)
                poisoned.append((entry, f"cannot apply event: {exc!r}"))
        return applied, poisoned

    def _parse_event(self, entry: Entry) -> FiredEvent | None:
        try:
            message = from_fields(EventMessage, entry.fields)
            trigger_id = int(message.trigger_id)
            if message.kind not in (EVENT_KIND_EVENT, EVENT_KIND_FAILURE):
                raise MalformedEntry(f"unknown event kind {message.kind!r}")
        except (MalformedEntry, ValueError) as exc:
            log.error("dead-lettering event entry %s: %s", entry.id, exc)
            self.broker.dead_letter(entry, GROUP_SCHEDULERS, f"bad event entry: {exc}")
            return None
        try:
            payload = serialization.loads(message.payload)
        except SerializationError as exc:
            # The task must not wait forever on an event nobody can read: fail it, saying why.
            failed, payload = (
                True,
                {"message": f"trigger {trigger_id} sent an unreadable event: {exc}"},
            )
        else:
            failed = message.kind == EVENT_KIND_FAILURE
        return FiredEvent(message.dedup_key, trigger_id, failed, payload)

    # -- periodic ----------------------------------------------------------------------------------

    def expire_deferrals(self) -> None:
        with self.sessions.begin() as session:
            expired = transitions.expire_deferrals(session, self.cipher)
        if expired:
            log.info("deferral timed out for task instance(s) %s", expired)

    def reconcile(self) -> None:
        """If Redis lost its data (the epoch key is gone), publish again from Postgres every
        deferred task's trigger and every queued task's attempt, then set the key."""
        keys = self.broker.keys
        if self.broker.redis.exists(keys.epoch):
            return
        with self.sessions() as session:
            rebuilt = reconcile.rebuild(session, keys, self.cipher)
        # Consumers recreate their groups from id 0 when they find them gone: no entry is missed.
        self.broker.publish_many(rebuilt.entries)
        self.broker.redis.set(keys.epoch, self.name)
        if rebuilt.unreadable:
            log.error("cannot rebuild trigger(s) %s: kwargs no longer decrypt", rebuilt.unreadable)
        if rebuilt.entries:
            log.warning(
                "rebuilt streams from Postgres: %d trigger(s), %d queued task(s)",
                rebuilt.triggers,
                rebuilt.queued,
            )

    def relay_outbox(self) -> None:
        relayed = outbox.relay(self.sessions, self.broker, RELAY_AFTER)
        if relayed:
            log.warning("relayed %d outbox row(s) whose publish was lost", relayed)


def _new_ti(task: BaseOperator) -> NewTaskInstance:
    return NewTaskInstance(
        task_id=task.task_id,
        max_tries=task.retries,
        pool=task.pool,
        pool_slots=task.pool_slots,
        queue=task.queue,
        priority_weight=task.priority_weight,
    )


def _task_of(tis: Sequence[TaskInstance], ti_id: int) -> str:
    return next(ti.task_id for ti in tis if ti.id == ti_id)
