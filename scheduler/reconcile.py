"""Postgres keeps checking Redis: what Postgres says must be in flight is compared with the
streams, a page at a time, and what is missing is published again.

- A deferred task's trigger must be in ``deferral:triggers`` (waiting or held by a triggerer) or
  its event in ``deferral:events`` (fired, not yet applied), unless it is a far timer not yet
  published (``deferral.store.far_timers``): that one is in no stream until its moment is near.
- A queued task's attempt must be in its queue stream.
- A running attempt's worker must be alive, or its queue entry still pending (then the workers'
  takeover deals with it); else the attempt is failed into a retry.

The in-flight indexes (see broker.streams.StreamKeys) answer "is it there" for a page of ids in one
Lua call. Republishing is safe because every consumer tolerates duplicates (a trigger entry for a
trigger already held replaces the held one, a queue entry starts an attempt only while the task is
queued at that try, events are dedup-keyed). Work that just changed is left alone for a few
seconds: its entry may be on its way.
"""

from __future__ import annotations

import datetime as dt
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
from sqlalchemy import BigInteger, Row, any_, bindparam, func, select, text
from sqlalchemy.dialects.postgresql import ARRAY
from sqlalchemy.orm import Session, sessionmaker

from broker.client import Broker
from broker.streams import queue_message, task_label, waiter_entry
from deferral import signals
from deferral.runtime import metrics
from deferral.runtime.crypto import Cipher, DecryptionError
from deferral.runtime.process import log_ids
from deferral.store import far_timers, liveness, transitions
from deferral.store.far_timers import TriggerWaiter
from deferral.store.tables import TaskInstance, Trigger, Worker
from deferral.store.transitions import Attempt

log = logging.getLogger("deferral.scheduler")

TI = TaskInstance
PAGE = 1000
MAX_REMEMBERED = 10_000
# Rows changed more recently than this may still have their entry on the way.
SETTLE = dt.timedelta(seconds=5)
# What republishing an attempt's queue entry (or naming it in a log line) needs.
ATTEMPT_COLUMNS = (TI.queue, TI.try_number, TI.dag_id, TI.run_id, TI.task_id, TI.map_index)


@dataclass
class Repairs:
    """What the reconciler remembers of its repairs (their counts are metrics)."""

    # Triggers whose kwargs no key opens, said once each (bounded: an operator fixes the keys).
    unreadable: set[int] = field(default_factory=set)


@dataclass
class _Cursor:
    """Where each sweep is: the last task instance id checked (0: start again)."""

    deferred: int = 0
    queued: int = 0
    running: int = 0


class Reconciler:
    def __init__(
        self,
        sessions: sessionmaker[Session],
        broker: Broker,
        cipher: Cipher,
        heartbeat_sec: float,
        page: int = PAGE,
    ) -> None:
        self.sessions = sessions
        self.broker = broker
        self.cipher = cipher
        self.heartbeat_sec = heartbeat_sec
        self.page = page
        self.cursor = _Cursor()
        self.repairs = Repairs()

    def reconcile(self) -> None:
        """One bounded pass: a page of deferred, of queued and of running task instances."""
        self._deferred()
        self._queued()
        self._running()

    def _page(
        self, session: Session, columns: Sequence[Any], state: str, after: int, *where: object
    ) -> tuple[list[Row[Any]], int]:
        """The next page of ``state`` task instances after id ``after``, those of them that
        match ``where``, as rows of ``columns`` (and the id), not ORM objects (loading those was
        most of a pass); and where the next page starts (0: from
        the first again). The page is taken by state and id alone, then filtered: a filter
        that leaves most rows out (signal waits, rows just changed) never makes the read walk
        on through every task in the state."""
        ids = list(
            session.scalars(
                select(TI.id)
                # Spelled as literal SQL so the planner uses ix_task_instance_state_id.
                .where(text(f"task_instance.state = '{state}'"), TI.id > after)
                .order_by(TI.id)
                .limit(self.page)
            )
        )
        if not ids:
            return [], 0
        rows = session.execute(
            select(TI.id, *columns)
            .where(TI.id == any_(bindparam("ids", ids, type_=ARRAY(BigInteger))), *where)  # type: ignore[arg-type]
            .order_by(TI.id)
        )
        return list(rows), ids[-1] if len(ids) == self.page else 0

    # -- deferred: their trigger (or its event) must be in a stream ------------------------------

    def _deferred(self) -> None:
        with self.sessions() as session:
            rows, next_page = self._page(
                session,
                [TI.trigger_id, TI.queue],
                "deferred",
                self.cursor.deferred,
                TI.updated_at < func.now() - SETTLE,
                TI.trigger_id.is_not(None),
                signals.not_a_wait(TI.trigger_id),  # a send resumes those, no stream entry
                far_timers.published(TI.trigger_id),  # a far timer is published when near
            )
        self.cursor.deferred = next_page
        by_trigger = {str(ti.trigger_id): ti for ti in rows}
        queue_of = {t: ti.queue for t, ti in by_trigger.items()}
        missing = [t for t, here in self.broker.triggers_present(queue_of).items() if not here]
        missing = [t for t, here in self.broker.events_present(missing).items() if not here]
        if missing:
            self._republish_triggers([by_trigger[t].id for t in missing])

    def _republish_triggers(self, ti_ids: list[int]) -> None:
        with self.sessions() as session:
            # Read again: only tasks still deferred on the same trigger need it.
            rows = session.execute(
                select(
                    Trigger.id.label("trigger_id"),
                    Trigger.classpath,
                    Trigger.kwargs.label("kwargs_token"),
                    TI.id.label("task_instance_id"),
                    *ATTEMPT_COLUMNS,
                )
                .join(Trigger, Trigger.id == TI.trigger_id)
                .where(
                    TI.id.in_(ti_ids),
                    text("task_instance.state = 'deferred'"),
                    Trigger.far_moment.is_(None),
                )
            ).all()
        entries = []
        for row in rows:
            try:
                entries.append(
                    waiter_entry(self.cipher, self.broker.keys, TriggerWaiter(**row._mapping))
                )
            except (DecryptionError, msgspec.DecodeError):
                trigger_id = row.trigger_id
                if trigger_id not in self.repairs.unreadable:
                    if len(self.repairs.unreadable) >= MAX_REMEMBERED:
                        self.repairs.unreadable.clear()
                    self.repairs.unreadable.add(trigger_id)
                    log.error(
                        "cannot republish trigger %d: its kwargs no longer decrypt", trigger_id
                    )
        if entries:
            self.broker.publish_many(entries)
            metrics.RECONCILER_REPAIRS.labels("triggers").inc(len(entries))
            log.warning(
                "reconciler: republished %d trigger(s) that no stream held (trigger ids %s)",
                len(entries),
                ", ".join(f["trigger_id"] for _, f in entries[:10]),
            )

    # -- queued: their attempt must be in their queue stream -------------------------------------

    def _queued(self) -> None:
        with self.sessions() as session:
            rows, next_page = self._page(
                session,
                ATTEMPT_COLUMNS,
                "queued",
                self.cursor.queued,
                TI.queued_at < func.now() - SETTLE,
            )
        self.cursor.queued = next_page
        by_queue: dict[str, list[Row[Any]]] = {}
        for ti in rows:
            by_queue.setdefault(ti.queue, []).append(ti)
        entries = []
        for queue, tis in by_queue.items():
            stream = self.broker.keys.queue(queue)
            here = self.broker.present(stream, [str(ti.id) for ti in tis])
            for ti in tis:
                if not here[str(ti.id)]:
                    message = queue_message(
                        self.cipher,
                        ti.id,
                        ti.try_number,
                        ti.dag_id,
                        ti.run_id,
                        ti.task_id,
                        ti.map_index,
                    )
                    entries.append((stream, msgspec.structs.asdict(message)))
        if entries:
            self.broker.publish_many(entries)
            metrics.RECONCILER_REPAIRS.labels("queue").inc(len(entries))
            log.warning(
                "reconciler: republished %d queued attempt(s) that no stream held"
                " (task instances %s)",
                len(entries),
                ", ".join(f["task_instance_id"] for _, f in entries[:10]),
            )

    # -- running: their worker must be alive, or their entry pending -----------------------------

    def _running(self) -> None:
        stale = dt.timedelta(seconds=liveness.stale_after_sec(self.heartbeat_sec))
        alive_worker = (
            select(Worker.name)
            .where(Worker.name == TI.worker, liveness.alive_clause(Worker, self.heartbeat_sec))
            .exists()
        )
        with self.sessions() as session:
            rows, next_page = self._page(
                session,
                [*ATTEMPT_COLUMNS, TI.worker],
                "running",
                self.cursor.running,
                TI.updated_at < func.now() - stale,
                ~alive_worker,
            )
        self.cursor.running = next_page
        orphans = []
        for ti in rows:
            stream = self.broker.keys.queue(ti.queue)
            if not self.broker.present(stream, [str(ti.id)])[str(ti.id)]:
                orphans.append(ti)
        if not orphans:
            return
        with self.sessions.begin() as session:
            for ti in orphans:
                reason = f"worker {ti.worker} stopped heartbeating and its queue entry is gone"
                attempt = Attempt(ti.id, ti.try_number, ti.worker or "")
                state = transitions.fail(session, attempt, reason, allow_retry=True)
                if state is not None:
                    metrics.RECONCILER_REPAIRS.labels("orphaned_attempt").inc()
                    label = task_label(ti.dag_id, ti.run_id, ti.task_id, ti.map_index)
                    log.warning(
                        "reconciler: %s try %d: %s; now %s",
                        label,
                        ti.try_number,
                        reason,
                        state,
                        extra=log_ids(task=label, task_instance_id=ti.id, try_number=ti.try_number),
                    )
