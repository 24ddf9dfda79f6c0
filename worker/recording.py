"""Recording what attempts ended with: a batch of outcomes in one transaction (successes and
deferrals in a few statements for the whole batch), then the failures' email alerts, the
scheduler's wake, the deferrals' trigger entries and the retirement of their queue entries. A
batch that fails on bad data is recorded one outcome at a time (``broker.service``), so the bad
one fails alone."""

from __future__ import annotations

import datetime as dt
import logging
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from sqlalchemy.orm import Session, sessionmaker

from broker import outbox
from broker.client import Broker
from broker.consumer import Delivery
from broker.consumers import ConsumerSet
from broker.service import batch_then_each, each_alone
from broker.streams import WAKE, StreamKeys, trigger_message
from deferral import signals
from deferral.runtime import metrics
from deferral.runtime.config import Settings
from deferral.runtime.crypto import Cipher
from deferral.runtime.process import LogExtra, log_ids
from deferral.store import tasklogs, transitions
from deferral.store import waits as row_waits
from deferral.store.tasklogs import SOURCE_WORKER, NewLine
from deferral.store.transitions import Attempt
from worker import record
from worker.mail import Mail, Mailer
from worker.outcomes import (
    AwaitingInput,
    Deferred,
    Failed,
    Outcome,
    Rescheduled,
    Skipped,
    Succeeded,
)

log = logging.getLogger("deferral.worker")

# What the worker says of a success, in its log and in the try's.
SUCCEEDED = "succeeded"

# The deferral_task_attempts label of each outcome ("dropped": fenced out, see Recorder._say).
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
        return line(self.attempt.task_instance_id, self.attempt.try_number, text)


def line(ti_id: int, try_number: int, text: str) -> NewLine:
    """A line of the worker's about an attempt, for its try's log."""
    return NewLine(ti_id, try_number, dt.datetime.now(dt.UTC), SOURCE_WORKER, text)


def write_lines(session: Session, lines: Sequence[NewLine], settings: Settings) -> None:
    """Store the worker's lines about attempts, last in the transaction that records what
    they say (task_log_try row locks are taken last: see tasklogs.append)."""
    tasklogs.append(session, lines, settings.task_log_max_bytes)


class Recorder:
    def __init__(
        self,
        settings: Settings,
        *,
        name: str,
        sessions: sessionmaker[Session],
        cipher: Cipher,
        keys: StreamKeys,
        broker: Broker,
        consumer: ConsumerSet,
        queue_of: dict[str, str],
        mailer: Mailer,
    ) -> None:
        self.settings = settings
        self.name = name
        self.sessions = sessions
        self.cipher = cipher
        self.keys = keys
        self.broker = broker
        self.consumer = consumer
        self.mailer = mailer
        # A deferred task's trigger goes to a triggers stream of the queue it ran from.
        self.queue_of = queue_of
        # Outcomes ended but not yet recorded because the servers failed: retried first.
        self.unrecorded: list[tuple[Running, Outcome]] = []
        # Outcomes of the batch being recorded, counted in the metrics once committed; and the
        # email alerts of its failures, sent once committed.
        self.tally: Counter[str] = Counter()
        self.mails: list[Mail] = []

    def record(self, batch: Sequence[tuple[Running, Outcome]]) -> None:
        """Record a batch of outcomes in one transaction, then publish and retire; a batch that
        fails on bad data is recorded one outcome at a time, so the bad one fails alone."""
        self.unrecorded = list(batch)
        self.tally, self.mails = Counter(), []
        staged = batch_then_each(
            batch,
            self._record_together,
            self._record_each,
            doing=f"recording {len(batch)} outcomes",
            logger=log,
        )
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
            [r.delivery.entry for r, _ in batch if self.consumer.holds(r.delivery.entry)]
        )

    def _record_together(self, batch: Sequence[tuple[Running, Outcome]]) -> list[outbox.Staged]:
        """Record ``batch`` in one transaction; if it rolls back, what it said did not happen."""
        before, mails_before = self.tally.copy(), len(self.mails)
        try:
            with self.sessions.begin() as session:
                return self._apply_batch(session, batch)
        except Exception:
            self.tally, self.mails = before, self.mails[:mails_before]
            raise

    def _record_each(self, batch: Sequence[tuple[Running, Outcome]]) -> list[outbox.Staged]:
        return [
            staged
            for one in each_alone(batch, lambda item: self._record_together([item]), self._refuse)
            for staged in one
        ]

    def _refuse(self, item: tuple[Running, Outcome], exc: Exception) -> None:
        """An outcome that cannot be recorded fails its attempt, saying why."""
        running = item[0]
        reason = f"cannot record its outcome: {type(exc).__name__}: {exc}"
        log.exception("%s %s", running.label, reason, extra=running.log_ids())
        with self.sessions.begin() as session:
            if transitions.fail(session, running.attempt, reason, allow_retry=False):
                write_lines(session, [running.log_line(f"{reason}: failed")], self.settings)
                self.tally["failed"] += 1

    def _apply_batch(
        self, session: Session, batch: Sequence[tuple[Running, Outcome]]
    ) -> list[outbox.Staged]:
        """Successes and deferrals, the common outcomes, in a few statements for the whole
        batch; the rest one by one."""
        successes = [(r, o) for r, o in batch if isinstance(o, Succeeded)]
        deferrals = [(r, o) for r, o in batch if isinstance(o, Deferred)]
        lines: list[NewLine] = []
        waits = _waits_of(deferrals)
        row_waits.lock_batch_keys(
            session,
            [r.attempt.task_instance_id for r, _ in successes],
            [event["name"] for _, o in successes for event in o.alias_events],
            [row.key for wait in waits.values() for row in wait.rows],
        )
        succeeded = record.succeed_all(
            session, self.cipher, [(r.attempt, o) for r, o in successes], said=SUCCEEDED
        )
        for running, success in successes:
            moved = running.attempt.task_instance_id in succeeded
            self._say(running, success, moved, SUCCEEDED, None)  # its line came with the move
        staged = self.defer_many(session, deferrals, lines, waits)
        for running, other in batch:
            if isinstance(other, Rescheduled | Skipped | Failed | AwaitingInput):
                self._apply_other(session, running, other, lines)
        write_lines(session, lines, self.settings)
        return staged

    def _say(
        self,
        running: Running,
        outcome: Outcome,
        moved: bool,
        said: str,
        lines: list[NewLine] | None,
    ) -> None:
        """Log what became of an attempt, and add it to the try's log ``lines`` if it counts
        (None: the statement that moved it wrote that line); tally it for the metrics."""
        self.tally[_OUTCOME_LABELS[type(outcome)] if moved else "dropped"] += 1
        if moved:
            level = logging.ERROR if isinstance(outcome, Failed) else logging.INFO
            log.log(level, "%s %s", running.label, said, extra=running.log_ids())
            if lines is not None:
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

    def defer_many(
        self,
        session: Session,
        deferrals: Sequence[tuple[Running, Deferred]],
        lines: list[NewLine],
        waits: dict[int, row_waits.Wait] | None = None,
    ) -> list[outbox.Staged]:
        """Write the deferrals' trigger rows and move their tasks, then stage their trigger
        entries; returns the outbox rows of those that moved. ``waits``: what of them is held
        as rows (task instance id -> wait), if the caller found it already."""
        horizon = dt.timedelta(seconds=self.settings.far_timer_horizon_sec)
        specs = [
            record.deferral_of(running.attempt, outcome, self.cipher, horizon)
            for running, outcome in deferrals
        ]
        # Signal waits are rows, not triggers run in a triggerer: no trigger entry for them.
        if waits is None:
            waits = _waits_of(deferrals)
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


def _waits_of(deferrals: Sequence[tuple[Running, Deferred]]) -> dict[int, row_waits.Wait]:
    """What of the deferrals is held as rows, by task instance id."""
    return {
        running.attempt.task_instance_id: wait
        for running, outcome in deferrals
        if (wait := record.wait_of(running.attempt, outcome)) is not None
    }
