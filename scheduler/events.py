"""Trigger events: deferred -> scheduled, and queued in the same transaction where pools and run
budgets allow (``scheduler.dispatch``), acknowledged only once that transaction commits; the
progress reports read with them recorded first (``deferral.store.progress``). An
event entry that cannot be read is dead-lettered; one that killed every scheduler that read it
resumes its task at ``__fail__``; a batch that fails on bad data is applied again one event at a
time, so the bad one alone is dead-lettered (``broker.service``)."""

from __future__ import annotations

import datetime as dt
import logging
import time
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import partial

from sqlalchemy.orm import Session, sessionmaker

from broker import outbox
from broker.client import Broker
from broker.consumer import Delivery
from broker.consumers import ConsumerSet
from broker.service import batch_then_each, each_alone, poisoned, read_each
from broker.streams import CarriedLog, Event, is_progress, is_wake, read_event, read_progress
from deferral.dag import DAG
from deferral.runtime import faults, metrics, serialization
from deferral.runtime.config import Settings
from deferral.runtime.crypto import Cipher
from deferral.runtime.process import log_ids
from deferral.runtime.serialization import SerializationError
from deferral.store import progress, tasklogs, transitions
from deferral.store.tasklogs import SOURCE_TRIGGERER, NewLine
from deferral.store.transitions import FiredEvent
from deferral.triggers.task_end import check_end_xcoms
from scheduler import end_callbacks
from scheduler.dispatch import Dispatcher

log = logging.getLogger("deferral.scheduler")

EVENT_BATCH = 2000

# What a batch of events came to: each applied event with what it did, those to dead-letter with
# why, and the queue entries of the tasks it queued.
Applied = tuple[
    list[tuple[Delivery, FiredEvent, transitions.Resumed]],
    list[tuple[Delivery, str]],
    list[outbox.Staged],
]


class EventApplier:
    def __init__(
        self,
        settings: Settings,
        *,
        sessions: sessionmaker[Session],
        cipher: Cipher,
        broker: Broker,
        consumer: ConsumerSet,
        dispatcher: Dispatcher,
        callbacks: ThreadPoolExecutor,
        dag: Callable[[str], DAG | None],
    ) -> None:
        self.settings = settings
        self.sessions = sessions
        self.cipher = cipher
        self.broker = broker
        self.consumer = consumer
        self.dispatcher = dispatcher
        self.callbacks = callbacks
        self.dag = dag
        # An event batch read but not yet recorded because the servers failed: retried first.
        self.unapplied: list[Delivery] = []

    def apply(self, block_ms: int | None) -> int:
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
                self.consumer.release(wakes)
                raise
        reports = [d for d in deliveries if is_progress(d.entry.fields)]
        if reports:
            self._record_progress(reports)
            deliveries = [d for d in deliveries if not is_progress(d.entry.fields)]
            self.unapplied = list(deliveries)
        if not deliveries:
            return len(reports)
        faults.inject("scheduler.events_read")
        read, unreadable = read_each(
            deliveries,
            lambda delivery: read_event(self.cipher, delivery.entry.fields),
            "event entry",
        )
        parsed = [(delivery, self._fired(delivery, event)) for delivery, event in read]
        self.consumer.dead_letter_many(unreadable)
        applied, refused, staged = batch_then_each(
            parsed,
            partial(self._apply, one_by_one=False),
            partial(self._apply, one_by_one=True),
            doing=f"applying {len(parsed)} events",
            logger=log,
        )
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
        end_callbacks.call_back_ended(self.sessions, self.callbacks, self.dag, ended)
        self.consumer.retire([d.entry for d, _, _ in applied])
        self.consumer.dead_letter_many(refused)
        return len(applied)

    def _record_progress(self, deliveries: Sequence[Delivery]) -> None:
        """Record the progress reports read (before the events read with them: a trigger's
        reports precede its event in its stream), in a transaction of their own, then retire
        them; one that cannot be read is dead-lettered."""
        read, unreadable = read_each(
            deliveries,
            lambda delivery: read_progress(self.cipher, delivery.entry.fields),
            "progress entry",
        )
        reports = sorted(read, key=lambda item: item[1].trigger_id)  # stable: in order per trigger
        with self.sessions.begin() as session:
            recorded = progress.record(
                session, [(report.trigger_id, report.sealed_payload) for _, report in reports]
            )
        metrics.TRIGGER_PROGRESS.inc(recorded)
        self.consumer.dead_letter_many(unreadable)
        self.consumer.retire([delivery.entry for delivery, _ in read])

    def _apply(self, parsed: Sequence[tuple[Delivery, FiredEvent]], *, one_by_one: bool) -> Applied:
        """Resume the events' tasks and queue those that can go, in one transaction (no
        savepoint: a batch that fails on bad data is rolled back whole and applied again one by
        one)."""
        refused: list[tuple[Delivery, str]] = []
        with self.sessions.begin() as session:
            faults.inject("scheduler.apply_events")
            if one_by_one:

                def refuse(item: tuple[Delivery, FiredEvent], exc: Exception) -> None:
                    delivery, event = item
                    log.exception(
                        "cannot apply event %s",
                        event.dedup_key,
                        extra=log_ids(trigger_id=event.trigger_id),
                    )
                    refused.append((delivery, f"cannot apply event: {exc!r}"))

                applied = each_alone(parsed, partial(self._resume_alone, session), refuse)
            else:
                resumed = transitions.resume_many(session, [e for _, e in parsed], self.cipher)
                applied = [(d, e, r) for (d, e), r in zip(parsed, resumed, strict=True)]
            resumed_ids = [r.task_instance_id for _, _, r in applied if r.task_instance_id]
            resumed_ids += [other for _, _, r in applied for other in r.others]
            staged = self.dispatcher.resumed(session, resumed_ids)
            # The triggerer's lines about what fired, in this transaction: before anything the
            # resumed attempts write (a duplicate's lines were stored with the first).
            lines = [line for _, e, r in applied if r.outcome != "duplicate" for line in e.log]
            tasklogs.append(session, lines, self.settings.task_log_max_bytes)
        return applied, refused, staged

    def _resume_alone(
        self, session: Session, item: tuple[Delivery, FiredEvent]
    ) -> tuple[Delivery, FiredEvent, transitions.Resumed]:
        delivery, event = item
        with session.begin_nested():
            return delivery, event, transitions.resume(session, event, self.cipher)

    def _fired(self, delivery: Delivery, event: Event) -> FiredEvent:
        """What an event entry read makes its task do: resume with the event, or at
        ``__fail__`` saying why (a poison, or an event nobody can read)."""
        reason = poisoned(self.consumer, delivery, f"event {event.dedup_key}")
        if reason is not None:
            # It killed every scheduler that read it: resume its task at __fail__ instead.
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

    def take_over(self) -> None:
        if not self.unapplied:
            self.unapplied = self.consumer.claim(EVENT_BATCH)


def _carried_lines(log: CarriedLog | None) -> tuple[NewLine, ...]:
    if log is None:
        return ()
    ti, try_number = log.task_instance_id, log.try_number
    return tuple(
        NewLine(ti, try_number, dt.datetime.fromtimestamp(at, dt.UTC), SOURCE_TRIGGERER, line)
        for at, line in log.lines
    )
