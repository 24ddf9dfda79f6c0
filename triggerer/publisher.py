"""Publishing what the triggers fired: each event and the retirement of its entry in one Lua call,
all of a batch in one round trip, retried while Redis fails (until published, an event exists
only in this process); each event takes the queued lines of its try's log with it. Entries
whose trigger no task waits on any more are retired here too."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import anyio
from redis.exceptions import RedisError

from broker.client import Broker
from broker.consumer import Backoff
from broker.consumers import ConsumerSet
from broker.replies import Entry
from broker.streams import (
    EVENT_KIND_FAILURE,
    EventMessage,
    MalformedEntry,
    StreamKeys,
    progress_message,
    to_fields,
    with_log,
)
from deferral.runtime import metrics, serialization
from deferral.runtime.crypto import Cipher
from deferral.runtime.outages import OUTAGE
from deferral.runtime.secrets_masker import mask_with_kwargs, redact
from deferral.runtime.serialization import SerializationError
from triggerer.events import Outcome, carried_json
from triggerer.held import Held, in_thread
from triggerer.logstore import TaskLogStore

log = logging.getLogger("deferral.triggerer")

# Events published in one round trip at most.
PUBLISH_BATCH = 1000
# How much of an event's payload its log line shows.
PAYLOAD_SHOWN = 1000


class Publisher:
    def __init__(
        self,
        broker: Broker,
        consumer: ConsumerSet,
        keys: StreamKeys,
        cipher: Cipher,
        task_logs: TaskLogStore,
        release: Callable[[int, Held], None],
        name: str,
    ) -> None:
        self.name = name  # the triggerer's, in each progress report
        self.broker = broker
        self.consumer = consumer
        self.keys = keys
        self.cipher = cipher
        self.task_logs = task_logs
        self.release = release  # frees a trigger's slot once its event is out
        # Events waiting to be published (with the triggers whose slot frees once they are),
        # and entries to retire (of timer triggers cancelled because their task no longer
        # waits, and entries a newer one replaced).
        self.items: list[tuple[int, Held, EventMessage]] = []
        self.retiring: list[Entry] = []
        # Progress entries (events stream, fields) to publish, before the events queued after
        # them: a trigger's progress reaches the scheduler ahead of its event.
        self.reports: list[tuple[str, dict[str, str]]] = []
        self.ready = anyio.Event()

    def progress(self, held: Held, payload: Any, trigger_kwargs: Any) -> None:
        """Queue a progress report of ``held``'s trigger (its secrets masked as an event's);
        one that cannot be carried (not JSON, too large) is logged and dropped."""
        try:
            shown = mask_with_kwargs(payload, trigger_kwargs)
            message = progress_message(
                self.cipher, held.trigger_id, carried_json(shown).decode(), self.name
            )
        except (SerializationError, MalformedEntry) as exc:
            log.warning(
                "trigger %d for %s: progress dropped: %s",
                held.trigger_id,
                held.task,
                exc,
                extra=held.log_ids(),
            )
            return
        self.reports.append((self.keys.events_beside(held.stream), to_fields(message)))
        self.ready.set()

    def retire(self, entry: Entry) -> None:
        """Retire ``entry`` with the next batch (retried while Redis fails: an entry left held
        would be renewed here for ever)."""
        self.retiring.append(entry)
        self.ready.set()

    def send(self, held: Held, outcome: Outcome) -> None:
        """Say what the trigger fired (or why it failed) and queue it for the publisher."""
        message = outcome.message
        if outcome.failure is not None:
            parts = (outcome.failure.message, outcome.failure.traceback)
            level, said = logging.ERROR, "failed: " + "\n".join(p for p in parts if p).rstrip()
        else:
            shown = serialization.shown(outcome.payload)
            if len(shown) > PAYLOAD_SHOWN:
                shown = shown[:PAYLOAD_SHOWN] + "..."
            level, said = logging.INFO, f"fired: {shown}"
        log.log(
            level,
            "trigger %d for %s %s",
            held.trigger_id,
            held.task,
            redact(said),
            extra=held.log_ids(),
        )
        self.items.append((held.trigger_id, held, message))
        self.ready.set()

    async def run(self) -> None:
        """Publish fired events in batches: each event and the retirement of its entry in one
        Lua call, all of a batch in one round trip; retried while Redis fails (until published,
        an event exists only in this process)."""
        while True:
            await self.ready.wait()
            await self.flush()

    async def flush(self) -> None:
        backoff = Backoff()
        while self.retiring:
            retiring = self.retiring[:PUBLISH_BATCH]
            try:
                await in_thread(self.consumer.retire, retiring)
            except RedisError as exc:
                OUTAGE.failed(exc, f"retiring {len(retiring)} entr(ies)")
                await anyio.sleep(backoff.next())
                continue
            del self.retiring[: len(retiring)]
        while self.reports:
            reports = self.reports[:PUBLISH_BATCH]
            try:
                await in_thread(self.broker.publish_many, reports)
            except RedisError as exc:
                OUTAGE.failed(exc, f"publishing {len(reports)} progress report(s)")
                await anyio.sleep(backoff.next())
                continue
            del self.reports[: len(reports)]
        while self.items:
            # Kept with their lines: a retry publishes the same.
            batch = await self._carry_task_logs(self.items[:PUBLISH_BATCH])
            self.items[: len(batch)] = batch
            items = [
                (held.entry, self.keys.events_beside(held.stream), to_fields(message))
                for _, held, message in batch
            ]
            try:
                await in_thread(self.consumer.hand_on_many, items)
            except RedisError as exc:
                OUTAGE.failed(exc, f"publishing {len(batch)} event(s)")
                await anyio.sleep(backoff.next())
                continue
            del self.items[: len(batch)]
            for trigger_id, held, message in batch:
                self.release(trigger_id, held)
                failed = message.kind == EVENT_KIND_FAILURE
                (metrics.TRIGGERS_FAILED if failed else metrics.TRIGGERS_FIRED).inc()
            OUTAGE.reached()
        self.ready = anyio.Event()

    async def _carry_task_logs(
        self, batch: list[tuple[int, Held, EventMessage]]
    ) -> list[tuple[int, Held, EventMessage]]:
        """Each event takes the queued lines of its try's log with it: the scheduler stores them
        in the transaction that applies the event, so they come before the resumed attempt's
        lines without a transaction here on the way to the event (lines too long to travel are
        stored first, as all were before)."""
        pending = {(h.task_instance_id, h.try_number) for _, h, m in batch if not m.log}
        if not pending:
            return batch
        carried_lines = await self.task_logs.take_for_events(pending)
        carrying = []
        for trigger_id, held, message in batch:
            carried = carried_lines.pop((held.task_instance_id, held.try_number), None)
            if carried is not None and not message.log:
                message = with_log(self.cipher, message, carried)
            carrying.append((trigger_id, held, message))
        return carrying
