"""The triggerer's lines about a trigger, kept for the log of the try that deferred on it.

A log record belongs to a try's log when it carries that try's ids as data (``log_ids`` with
``task_instance_id`` and ``try_number``: the service's own lines about a trigger), or when it is
emitted while a trigger's own code runs (its task sets :data:`current_ids`), so a trigger's
``self.log`` lines are kept too. The handler only queues lines (it runs on the event loop); the
service stores them in batches (:meth:`TaskLogHandler.take`).
"""

from __future__ import annotations

import contextvars
import datetime as dt
import logging
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec

from broker.streams import MAX_CARRIED_LOG, CarriedLog
from deferral.runtime.process import LOG_IDS_ATTR
from deferral.store.tasklogs import LOG_FORMAT, SOURCE_TRIGGERER, NewLine, clean

# The ids of the trigger whose code runs in the current asyncio task (set in its task only).
current_ids: contextvars.ContextVar[dict[str, Any] | None] = contextvars.ContextVar(
    "deferral_trigger_ids", default=None
)

TryKey = tuple[int, int]  # (task instance id, try number)

# Lines waiting at most, while Postgres does not answer: older ones are kept, newer dropped.
MAX_QUEUED = 100_000


class TaskLogHandler(logging.Handler):
    def __init__(self, max_queued: int = MAX_QUEUED) -> None:
        super().__init__(logging.INFO)
        self.setFormatter(logging.Formatter(LOG_FORMAT))
        self.max_queued = max_queued
        self.dropped = 0
        self._queued: list[NewLine] = []

    def emit(self, record: logging.LogRecord) -> None:
        ids = getattr(record, LOG_IDS_ATTR, None) or current_ids.get()
        if not ids or "task_instance_id" not in ids or "try_number" not in ids:
            return
        if len(self._queued) >= self.max_queued:
            self.dropped += 1
            return
        at = dt.datetime.fromtimestamp(record.created, dt.UTC)
        line = NewLine(
            ids["task_instance_id"], ids["try_number"], at, SOURCE_TRIGGERER, self.format(record)
        )
        self._queued.append(line)

    def said(self, task_instance_id: int, try_number: int, logger: str, message: str) -> None:
        """Queue an INFO line for one try's log only, as a record carrying its ids would be
        (without building the record: a takeover queues a line for each of a thousand
        timers; triggerer rule 36)."""
        if len(self._queued) >= self.max_queued:
            self.dropped += 1
            return
        text = LOG_FORMAT % {"levelname": "INFO", "name": logger, "message": message}
        at = dt.datetime.now(dt.UTC)
        self._queued.append(NewLine(task_instance_id, try_number, at, SOURCE_TRIGGERER, text))

    def take(self) -> list[NewLine]:
        """The queued lines, in order; the queue is emptied."""
        with self.lock:  # type: ignore[union-attr]
            lines, self._queued = self._queued, []
        return lines

    def put_back(self, lines: Sequence[NewLine]) -> None:
        """Lines that could not be stored: first in the queue again, for the next batch."""
        with self.lock:  # type: ignore[union-attr]
            self._queued[:0] = lines[: max(self.max_queued - len(self._queued), 0)]


@dataclass
class Split:
    """Queued lines sorted for a batch of events: ``carried`` travel with the event of their try,
    ``store_first`` must be stored before the events are published (too long to travel, or of
    a try whose number the entry did not say), ``rest`` belong to no event of the batch."""

    carried: dict[TryKey, CarriedLog] = field(default_factory=dict)
    store_first: list[NewLine] = field(default_factory=list)
    rest: list[NewLine] = field(default_factory=list)


def split_for_events(
    lines: Sequence[NewLine], tries: Collection[TryKey], max_chars: int = MAX_CARRIED_LOG
) -> Split:
    """Which of the queued ``lines`` travel with the events of ``tries``. Texts are masked here,
    by the process that knows the secrets its triggers read."""
    split = Split()
    by_try: dict[TryKey, list[NewLine]] = {}
    for line in lines:
        key = (line.task_instance_id, line.try_number)
        if key not in tries:
            split.rest.append(line)
        elif line.try_number == 0:
            split.store_first.append(line)
        else:
            by_try.setdefault(key, []).append(line)
    for key, kept in by_try.items():
        log = CarriedLog(*key, [(line.at.timestamp(), clean(line.text)) for line in kept])
        if len(msgspec.json.encode(log)) > max_chars:
            split.store_first += kept
        else:
            split.carried[key] = log
    return split
