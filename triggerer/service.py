"""``triggerer consume``: a consumer-group member of ``deferral:triggers`` that runs every trigger
it holds concurrently in one anyio event loop and publishes each trigger's first event.

An entry stays pending (owned by this consumer) while its trigger runs; it is acknowledged and
deleted in the same Lua call that publishes the event, so no event is published for an entry that
another triggerer could still take and run.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import traceback
from dataclasses import dataclass
from typing import Any

import anyio
from anyio.abc import TaskGroup
from redis.exceptions import RedisError
from sqlalchemy import func, select, update
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.exc import SQLAlchemyError

from broker.client import AsyncBroker
from broker.lease import Lease
from broker.replies import Entry
from broker.streams import GROUP_TRIGGERERS, EventMessage, to_fields
from deferral.config import Settings
from deferral.crypto import Cipher
from deferral.dagbag import put_on_sys_path
from deferral.db import make_engine, make_sessionmaker
from deferral.models import TaskInstance, TaskStateChange, Trigger, Triggerer
from deferral.states import TaskState
from deferral.triggers.base import BaseTrigger
from triggerer import decide
from triggerer.decode import Decoded, RejectedEntry, decode_entry
from triggerer.events import event_message, failure_message
from triggerer.watchdog import LoopWatchdog

log = logging.getLogger("deferral.triggerer")

# Synchronous code that holds the event loop this long delays every other trigger: say so.
BLOCKED_LOOP_WARN_SEC = 0.2

# At most this many new entries per read, so one replica never drains the stream its peers share.
READ_BATCH = 100


@dataclass
class Held:
    """A trigger this triggerer runs, the stream entry it holds a lease on, and, once it is
    cancelled, why (shutdown, reassigned, timeout, user action, superseded)."""

    entry: Entry
    scope: anyio.CancelScope
    task: str
    task_instance_id: int
    cancel_reason: str = "shutdown"
    # Cancelled because its task no longer waits on it: retire the entry too.
    retire: bool = False

    def cancel(self, reason: str, *, retire: bool = False) -> None:
        if not self.scope.cancel_called:
            self.cancel_reason, self.retire = reason, retire
            self.scope.cancel()


class TriggererService:
    def __init__(self, settings: Settings, *, capacity: int, name: str) -> None:
        self.settings = settings
        self.capacity = capacity
        self.name = name
        self.cipher = Cipher(settings.fernet_keys)
        self.sessions = make_sessionmaker(make_engine(settings.database_url, pool_size=2))
        # Triggers may live in DAGs-folder modules (still only under DEFERRAL_TRIGGER_MODULES).
        put_on_sys_path(settings.dags_folder)
        self.held: dict[int, Held] = {}
        self.slot_freed = anyio.Event()
        self.lease = Lease.of(settings.heartbeat_sec)
        self.broker: AsyncBroker

    async def run(self) -> None:
        self.broker = await AsyncBroker.from_url(
            self.settings.redis_url, self.settings.stream_prefix
        )
        stream = self.broker.keys.triggers
        await self.broker.ensure_group(stream, GROUP_TRIGGERERS)
        await self._register("running")
        log.info("triggerer %s consuming %s, capacity %d", self.name, stream, self.capacity)
        try:
            async with anyio.create_task_group() as tasks:
                tasks.start_soon(self._stop_on_signal, tasks.cancel_scope)
                tasks.start_soon(self._heartbeat, tasks, stream)
                tasks.start_soon(LoopWatchdog(BLOCKED_LOOP_WARN_SEC, _warn_blocked).run)
                await self._consume(tasks, stream)
        finally:
            with anyio.CancelScope(shield=True):
                await self._hand_off(stream)
                await self._register("stopped")
                await self.broker.close()
        log.info("triggerer %s stopped", self.name)

    async def _stop_on_signal(self, scope: anyio.CancelScope) -> None:
        with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async for signum in signals:
                log.info(
                    "received %s: cancelling %d trigger(s) (reason: shutdown)",
                    signal.Signals(signum).name,
                    len(self.held),
                )
                scope.cancel()
                return

    async def _consume(self, tasks: TaskGroup, stream: str) -> None:
        # Entries this consumer name already owns (a restart under a stable --name) come first.
        cursor = "0-0"
        while True:
            free = self.capacity - len(self.held)
            if free <= 0:
                self.slot_freed = anyio.Event()
                await self.slot_freed.wait()
                continue
            try:
                entries = await self.broker.read(
                    GROUP_TRIGGERERS,
                    self.name,
                    {stream: cursor},
                    count=min(free, READ_BATCH),
                    block_ms=1000 if cursor == ">" else None,
                )
            except RedisError as exc:
                # Redis restarting, or the stream or group lost: wait, recreate, read again.
                log.warning("reading %s failed: %s; retrying", stream, exc)
                await anyio.sleep(1)
                with contextlib.suppress(RedisError):
                    await self.broker.ensure_group(stream, GROUP_TRIGGERERS)
                continue
            if cursor != ">":
                # Walk our own pending history by id; an empty page means it is all running.
                cursor = entries[-1].id if entries else ">"
            await self._start_all(tasks, entries)

    async def _start_all(self, tasks: TaskGroup, entries: list[Entry]) -> None:
        started = [await self._start(tasks, entry) for entry in entries]
        await self._mark_owned([tid for tid in started if tid is not None])

    async def _start(self, tasks: TaskGroup, entry: Entry) -> int | None:
        if not entry.fields:
            return None  # deleted while pending: nothing left to run
        try:
            decoded = decode_entry(entry, self.cipher, self.settings.trigger_modules)
        except RejectedEntry as exc:
            await self._reject(entry, exc)
            return None
        trigger_id = decoded.spec.trigger_id
        running = self.held.get(trigger_id)
        if running is not None:
            if running.entry.id != entry.id:
                # A second entry for a trigger running here (an outbox re-publish): the running
                # one holds its own entry, so this one can go.
                await self.broker.ack_delete(entry.stream, GROUP_TRIGGERERS, [entry.id])
            return None
        held = Held(entry, anyio.CancelScope(), decoded.spec.task, decoded.spec.task_instance_id)
        self.held[trigger_id] = held
        # The task name is what the watchdog reports when this trigger blocks the loop.
        name = f"trigger {trigger_id} ({decoded.spec.classpath}) for {decoded.spec.task}"
        tasks.start_soon(self._run_trigger, held, decoded, name=name)
        return trigger_id

    async def _reject(self, entry: Entry, exc: RejectedEntry) -> None:
        log.error("%s (entry %s)", exc, entry.id)
        if exc.trigger_id is not None:
            # Fail the task the entry names, with the reason, rather than leave it deferred.
            failure = failure_message(exc.trigger_id, str(exc), "", self.name)
            await self.broker.publish(self.broker.keys.events, failure)
        await self.broker.dead_letter(entry, GROUP_TRIGGERERS, str(exc))

    async def _run_trigger(self, held: Held, decoded: Decoded) -> None:
        trigger, trigger_id = decoded.trigger, decoded.spec.trigger_id
        try:
            with held.scope:
                message = await self._first_event(trigger, trigger_id)
                await self._publish(held.entry, message)
                log.info("trigger %d for %s: %s sent", trigger_id, held.task, message.kind)
            if held.scope.cancelled_caught:
                self._log_cancelled(trigger_id, held)
                if held.retire:
                    await self._retire(held, trigger)
        except anyio.get_cancelled_exc_class():
            self._log_cancelled(trigger_id, held)  # the whole triggerer is stopping
            raise
        except Exception:
            # Never let one trigger take the event loop (and every other trigger) down; its entry
            # stays pending, so it is not lost.
            log.exception("trigger %d for %s: unexpected error", trigger_id, held.task)
        finally:
            self.held.pop(trigger_id, None)
            self.slot_freed.set()

    async def _retire(self, held: Held, trigger: BaseTrigger) -> None:
        """The task no longer waits on this trigger: run on_kill() if a user cancelled it, and
        drop the entry so nobody runs the trigger again."""
        with anyio.CancelScope(shield=True):
            if held.cancel_reason == decide.USER_ACTION:
                try:
                    await trigger.on_kill()
                except Exception:
                    log.exception("on_kill() of the trigger for %s raised", held.task)
            await self.broker.ack_delete(held.entry.stream, GROUP_TRIGGERERS, [held.entry.id])

    @staticmethod
    def _log_cancelled(trigger_id: int, held: Held) -> None:
        log.info(
            "trigger %d for %s cancelled (reason: %s)", trigger_id, held.task, held.cancel_reason
        )

    # -- leases ----------------------------------------------------------------------------------

    async def _heartbeat(self, tasks: TaskGroup, stream: str) -> None:
        while True:
            await anyio.sleep(self.settings.heartbeat_sec)
            try:
                await self._renew(stream)
                await self._drop_unwanted()
                await self._take_over(tasks, stream)
                await self._register("running")
            except (RedisError, SQLAlchemyError) as exc:
                # Keep running: a lease missed now is renewed next beat, or taken over by a peer.
                log.warning("heartbeat failed: %s", exc)

    async def _renew(self, stream: str) -> None:
        """Renew our entries; stop the triggers whose entry a peer has taken over."""
        by_entry = {held.entry.id: held for held in self.held.values()}
        owned = set(await self.broker.renew(stream, GROUP_TRIGGERERS, self.name, list(by_entry)))
        for entry_id, held in by_entry.items():
            if entry_id not in owned:
                held.cancel("reassigned")

    async def _drop_unwanted(self) -> None:
        """Cancel the triggers whose task no longer waits on them (timed out, cleared, marked)."""
        held = dict(self.held)
        if not held:
            return
        ti_ids = [h.task_instance_id for h in held.values()]

        left_deferred = (
            select(TaskStateChange.reason)
            .where(
                TaskStateChange.task_instance_id == TaskInstance.id,
                TaskStateChange.from_state == TaskState.DEFERRED,
            )
            .order_by(TaskStateChange.id.desc())
            .limit(1)
            .scalar_subquery()
        )
        query = select(
            TaskInstance.id, TaskInstance.state, TaskInstance.trigger_id, left_deferred
        ).where(TaskInstance.id.in_(ti_ids))

        def read() -> dict[int, tuple[str, int | None, str | None]]:
            with self.sessions() as session:
                return {row[0]: (row[1], row[2], row[3]) for row in session.execute(query)}

        now = await anyio.to_thread.run_sync(read)
        for trigger_id, item in held.items():
            state, ti_trigger_id, next_method = now.get(item.task_instance_id, (None, None, None))
            reason = decide.cancel_reason(trigger_id, state, ti_trigger_id, next_method)
            if reason is not None:
                item.cancel(reason, retire=True)

    async def _take_over(self, tasks: TaskGroup, stream: str) -> None:
        """Run the triggers of entries whose owner stopped renewing them (a dead triggerer)."""
        free = self.capacity - len(self.held)
        if free <= 0:
            return
        claimed = await self.broker.autoclaim(
            stream,
            GROUP_TRIGGERERS,
            self.name,
            min_idle_ms=self.lease.takeover_after_ms,
            count=min(free, READ_BATCH),
        )
        if claimed:
            log.info("took over %d trigger entr(ies) from a stopped triggerer", len(claimed))
            await self._start_all(tasks, claimed)

    async def _hand_off(self, stream: str) -> None:
        """On the way out, make our entries look long idle so that peers take them at once
        instead of after the takeover delay."""
        try:
            ids = await self.broker.pending_ids(stream, GROUP_TRIGGERERS, self.name)
            await self.broker.hand_off(
                stream, GROUP_TRIGGERERS, self.name, ids, idle_ms=self.lease.hand_off_idle_ms
            )
        except RedisError as exc:
            log.warning("could not hand off entries: %s (peers take them after the delay)", exc)
            return
        if ids:
            log.info("handed off %d trigger entr(ies)", len(ids))

    async def _publish(self, entry: Entry, message: EventMessage) -> None:
        """Publish the event and retire the entry, retrying while Redis fails: until it is
        published, the event exists only in this process."""
        delay = 0.1
        while True:
            try:
                await self.broker.publish_and_ack(
                    entry, GROUP_TRIGGERERS, self.broker.keys.events, to_fields(message)
                )
                return
            except RedisError as exc:
                log.warning("publishing event %s failed (%s); retrying", message.dedup_key, exc)
                await anyio.sleep(delay)
                delay = min(delay * 2, 5.0)

    async def _first_event(self, trigger: BaseTrigger, trigger_id: int) -> EventMessage:
        """Run the trigger to its first event; a raise or an end without an event is a failure.
        ``cleanup()`` always runs, and its own failure fails the task too."""
        message: EventMessage | None = None
        try:
            events = trigger.run()
            try:
                async for event in events:
                    message = event_message(trigger_id, event.payload, self.name)
                    break
            finally:
                await events.aclose()  # type: ignore[attr-defined]
            if message is None:
                message = failure_message(
                    trigger_id, f"trigger {trigger_id} ended without an event", "", self.name
                )
        except anyio.get_cancelled_exc_class():
            raise
        except Exception as exc:
            message = failure_message(
                trigger_id,
                f"trigger {trigger_id} raised {type(exc).__name__}: {exc}",
                traceback.format_exc(),
                self.name,
            )
        finally:
            with anyio.CancelScope(shield=True):
                try:
                    await trigger.cleanup()
                except Exception as exc:
                    log.exception("trigger %d cleanup() raised", trigger_id)
                    if message is not None and message.kind == "event":
                        message = failure_message(
                            trigger_id,
                            f"trigger {trigger_id} cleanup() raised {exc!r}",
                            traceback.format_exc(),
                            self.name,
                        )
        return message

    # -- bookkeeping in Postgres (for the CLI and doctor) ----------------------------------------

    async def _register(self, state: str) -> None:
        values: dict[str, Any] = {
            "name": self.name,
            "hostname": socket.gethostname(),
            "pid": os.getpid(),
            "capacity": self.capacity,
            "load": len(self.held),
            "state": state,
        }

        def write() -> None:
            statement = insert(Triggerer).values(**values)
            with self.sessions.begin() as session:
                session.execute(
                    statement.on_conflict_do_update(
                        index_elements=[Triggerer.name],
                        set_={**values, "latest_heartbeat": func.now()},
                    )
                )

        await anyio.to_thread.run_sync(write)

    async def _mark_owned(self, trigger_ids: list[int]) -> None:
        if not trigger_ids:
            return

        def write() -> None:
            with self.sessions.begin() as session:
                session.execute(
                    update(Trigger)
                    .where(Trigger.id.in_(trigger_ids))
                    .values(triggerer_id=self.name)
                )

        await anyio.to_thread.run_sync(write)


def _warn_blocked(culprit: str, seconds: float) -> None:
    log.warning(
        "%s blocked the event loop for %.2f s: move blocking calls off the loop "
        "(anyio.to_thread.run_sync)",
        culprit,
        seconds,
    )
