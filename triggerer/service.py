"""``triggerer consume``: a consumer-group member of ``deferral:triggers`` that runs every trigger
it holds concurrently in one anyio event loop and publishes each trigger's first event.

An entry stays pending (owned by this consumer) while its trigger runs; it is retired in the same
Lua call that publishes the event, so no event is published for an entry that another triggerer
could still take and run. Events that fire together are published together, in one round trip.
Redis is spoken to through the shared synchronous consumer core, from worker threads. The
leases are kept by a thread of their own (``leases.LeaseKeeper``), and a watchdog thread names
the trigger that stalls the loop (``watchdog``): no trigger's synchronous code can cost the
others their leases.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import heapq
import itertools
import logging
import math
import os
import signal
import socket
import threading
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import anyio
import anyio.lowlevel
import anyio.to_thread
from anyio.abc import TaskGroup
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream
from redis.exceptions import RedisError
from sqlalchemy import func, select, text
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session, sessionmaker

from broker.client import Broker, LeaseStatus, connect_when_up
from broker.consumer import Backoff, Delivery, Lost, Quarantine, StreamConsumer
from broker.consumers import ConsumerSet
from broker.owners import PostgresOwners
from broker.replies import Entry
from broker.streams import (
    EVENT_KIND_FAILURE,
    GROUP_TRIGGERERS,
    MAX_DEAD_ERROR,
    EventMessage,
    StreamKeys,
    TriggerSpec,
    one_line,
    to_fields,
    with_log,
)
from broker.trigger_rows import SpecVerdict, TriggerRow, spec_check, trigger_rows
from deferral.loading.dagbag import put_on_sys_path
from deferral.runtime import metrics, serialization
from deferral.runtime.config import Settings
from deferral.runtime.crypto import Cipher
from deferral.runtime.faults import is_transient
from deferral.runtime.process import LOG_IDS_ATTR, LogExtra, freeze_startup_objects, log_ids
from deferral.runtime.secrets_masker import redact
from deferral.states import TaskState
from deferral.store import liveness, tasklogs
from deferral.store.db import make_engine, make_sessionmaker, wait_until_up
from deferral.store.queues import recorded
from deferral.store.tables import TaskInstance, TaskStateChange, Triggerer
from deferral.store.tasklogs import NewLine
from deferral.triggers.base import BaseTrigger
from triggerer import decide, tasklog
from triggerer.decode import Decoded, RejectedEntry, instantiate, open_spec
from triggerer.events import (
    Outcome,
    event_outcome,
    failure_message,
    first_event,
    masked,
    raised_outcome,
)
from triggerer.leases import LeaseKeeper
from triggerer.tasklog import TaskLogHandler, current_ids
from triggerer.watchdog import LoopWatchdog
from triggerer.watchers import WatcherRunner

log = logging.getLogger("deferral.triggerer")

# Entries taken over per claim at most (new ones are read DEFERRAL_TRIGGERER_CLAIM_PER_LOOP at
# a time, so one replica never drains the stream its peers share).
READ_BATCH = 100
# The shortest loop that read a whole DEFERRAL_TRIGGERER_CLAIM_PER_LOOP while another triggerer
# is alive: one that finds a backlog takes its share and leaves its peers theirs, whatever its
# CPU share (at most 500 new triggers a second at the default claim; a raised claim raises it).
# A triggerer alone reads at full speed.
CLAIM_LOOP_SEC = 0.1
# An idle read waits this long for entries. A SIGTERM waits for the read in flight (a thread
# cannot be interrupted), so this bounds how soon a stopping triggerer hands off and exits.
READ_BLOCK_MS = 250
# Events published in one round trip at most.
PUBLISH_BATCH = 1000
# How close to a timer's moment the loop polls for it instead of sleeping (a sleep ends up to a
# millisecond late).
TIMER_SPIN_SEC = 0.0015
# Timers fired before the publisher may run (10,000 due at once would otherwise all be fired,
# logged and signed before the first is published).
FIRE_BATCH = 250
# How often the lines about triggers are stored in their tries' logs (a fired trigger's lines
# travel with its event instead, so that they precede the resumed attempt's lines).
TASK_LOG_INTERVAL_SEC = 1.0
# How much of an event's payload its log line shows.
PAYLOAD_SHOWN = 1000


@dataclass(eq=False, slots=True)
class Held:
    """A trigger this triggerer runs, the stream entry it holds a lease on (its fields dropped
    once decoded), and, once it is cancelled, why (shutdown, reassigned, timeout, user_action,
    superseded). A trigger that only waits for a moment has no task (``scope`` None): it waits
    on the shared timer, at ``moment``."""

    trigger_id: int
    entry: Entry
    scope: anyio.CancelScope | None
    task: str
    task_instance_id: int
    # The try that deferred on it (0: unknown, an older entry), whose log the lines go to.
    try_number: int
    moment: dt.datetime | None = None
    # A timer's event, built as it is held: at its moment it is only logged and published
    # (sealing and signing it there delayed moment -> event readable).
    event: Outcome | None = None
    cancel_reason: str = "shutdown"
    # Cancelled because its task no longer waits on it: retire the entry too.
    retire: bool = False
    cancelled: bool = False

    def log_ids(self) -> LogExtra:
        """``extra=`` for a log line about this trigger and the task waiting on it (such lines
        go to the try's log too)."""
        return log_ids(
            task=self.task,
            task_instance_id=self.task_instance_id,
            try_number=self.try_number,
            trigger_id=self.trigger_id,
        )


@dataclass
class _Outgoing:
    """Events waiting to be published (with the triggers whose slot frees once they are), and
    entries to retire (of timer triggers cancelled because their task no longer waits)."""

    items: list[tuple[int, Held, EventMessage]] = field(default_factory=list)
    retiring: list[Entry] = field(default_factory=list)
    ready: anyio.Event = field(default_factory=anyio.Event)


class _Timers:
    """Triggers that only wait for a moment, on one shared timer: a heap of (moment, held)."""

    def __init__(self) -> None:
        self._heap: list[tuple[dt.datetime, int, Held]] = []
        self._order = itertools.count()  # ties broken by arrival, never by comparing Helds
        self._changed = anyio.Event()

    def add(self, held: Held) -> None:
        assert held.moment is not None
        earliest = not self._heap or held.moment < self._heap[0][0]
        heapq.heappush(self._heap, (held.moment, next(self._order), held))
        if earliest:
            self._changed.set()

    async def run(self, fire: Callable[[Held], None]) -> None:
        """Fire every held timer whose moment has come, as it comes; many due at once are fired
        FIRE_BATCH at a time, the publisher sending each batch while the next is fired."""
        while True:
            now = dt.datetime.now(dt.UTC)
            fired = 0
            while self._heap and self._heap[0][0] <= now:
                fire(heapq.heappop(self._heap)[2])
                fired += 1
                if fired % FIRE_BATCH == 0:
                    await anyio.lowlevel.checkpoint()
            wait = (self._heap[0][0] - now).total_seconds() if self._heap else 60.0
            if wait <= TIMER_SPIN_SEC:
                # The loop's sleeps end on the next whole millisecond: the last one is polled.
                await anyio.lowlevel.checkpoint()
                continue
            # Wake for the next moment, a newer earlier one, or at least every minute (a clock
            # step must not stretch a wait).
            self._changed = anyio.Event()
            with anyio.move_on_after(min(wait - TIMER_SPIN_SEC, 60.0)):
                await self._changed.wait()


@dataclass(frozen=True, slots=True)
class Rejected:
    """An entry to dead-letter, why, and the trigger whose task to fail (an authentic entry)."""

    delivery: Delivery
    reason: str
    fail_trigger: int | None


@dataclass(frozen=True, slots=True)
class Run:
    """A trigger whose ``run()`` is to start as a task, once its start evidence is written."""

    delivery: Delivery
    held: Held
    decoded: Decoded


@dataclass(frozen=True, slots=True)
class RunningTrigger:
    """Who an asyncio task running a trigger's ``run()`` is: what a stall report names."""

    held: Held
    classpath: str


def _slim(entry: Entry, trigger_id: int) -> Entry:
    # Keep what retiring needs (the index field), not the token: memory per held trigger.
    return Entry(entry.stream, entry.id, {b"trigger_id": str(trigger_id).encode()})


def _array(ids: list[int]) -> str:
    """A Postgres array literal of ``ids``, for ``CAST(:x AS bigint[])``."""
    return "{" + ",".join(map(str, ids)) + "}"


class TriggererService:
    def __init__(
        self,
        settings: Settings,
        *,
        capacity: int,
        name: str,
        queues: Sequence[str] | None = None,
    ) -> None:
        self.settings = settings
        self.capacity = capacity
        self.name = name
        self.queues = None if queues is None else tuple(queues)  # None: every queue
        self.cipher = Cipher(settings.fernet_keys)
        self.engine = make_engine(settings.database_url, pool_size=2)
        self.sessions = make_sessionmaker(self.engine)
        self.keys = StreamKeys.for_redis(
            settings.stream_prefix, settings.redis_url, settings.stream_shards
        )
        # Triggers may live in DAGs-folder modules (still only under DEFERRAL_TRIGGER_MODULES).
        put_on_sys_path(settings.dags_folder)
        self.held: dict[int, Held] = {}
        self.slot_freed = anyio.Event()
        self.outgoing = _Outgoing()
        self.timers = _Timers()
        self.stopping = threading.Event()  # for waits in threads (servers down at start)
        self.task_log = TaskLogHandler()
        self.task_log_written = anyio.Lock()  # batches are stored one after the other, in order
        # Triggers started here whose trigger.triggerer_id is not written yet: written with the
        # next batch of task log lines, in its transaction.
        self.owned: list[int] = []
        # The tasks running triggers' run(), for the watchdog thread to name a stall's culprit.
        self.trigger_tasks: dict[asyncio.Task[Any], RunningTrigger] = {}
        self.broker: Broker
        self.consumer: ConsumerSet
        self.leases: LeaseKeeper | None = None
        self.peers: int | None = None  # other live triggerers (None: not counted yet)
        metrics.TRIGGERS_RUNNING.set_function(lambda: len(self.held))
        metrics.TRIGGERER_CAPACITY_LEFT.set_function(lambda: self.capacity - len(self.held))

    async def _sync(self, func: Any, *args: Any) -> Any:
        return await anyio.to_thread.run_sync(partial(func, *args), abandon_on_cancel=False)

    async def run(self) -> None:
        root = logging.getLogger()
        root.addHandler(self.task_log)
        try:
            async with anyio.create_task_group() as tasks:
                tasks.start_soon(self._stop_on_signal, tasks.cancel_scope)
                await self._serve(tasks)
                tasks.cancel_scope.cancel()
        except* SystemExit as exits:  # a Redis it cannot use (connect_when_up): its one line
            raise exits.exceptions[0] from None
        finally:
            root.removeHandler(self.task_log)
        log.info("triggerer %s stopped", self.name)

    async def _serve(self, outer: TaskGroup) -> None:
        broker = await anyio.to_thread.run_sync(
            connect_when_up,
            self.settings.redis_url,
            self.settings.stream_prefix,
            self.stopping,
            self.settings.stream_shards,
        )
        if broker is None or not await anyio.to_thread.run_sync(
            wait_until_up, self.engine, self.stopping
        ):
            return
        self.attach(broker)
        await self._until_done(self.consumer.start)
        await self._until_done(self._register, liveness.RUNNING)
        lease_broker = await anyio.to_thread.run_sync(
            connect_when_up,
            self.settings.redis_url,
            self.settings.stream_prefix,
            self.stopping,
            self.settings.stream_shards,
        )
        if lease_broker is None:
            return
        freeze_startup_objects()
        log.info(
            "triggerer %s consuming %s, capacity %d",
            self.name,
            ", ".join(self.consumer.streams) + ("" if self.queues else " and every new queue's"),
            self.capacity,
        )
        beats_in, beats_out = anyio.create_memory_object_stream[list[Lost]](math.inf)
        self.leases = self._lease_keeper(lease_broker, asyncio.get_running_loop(), beats_in)
        self.leases.start()
        try:
            async with anyio.create_task_group() as tasks:
                tasks.start_soon(self._after_beats, beats_out)
                tasks.start_soon(self._take_overs, tasks)
                tasks.start_soon(self._publisher)
                tasks.start_soon(self.timers.run, self._timer_fired)
                tasks.start_soon(self._write_task_logs)
                tasks.start_soon(self._watchers().run)
                watchdog: LoopWatchdog[RunningTrigger | str] = LoopWatchdog(
                    self.settings.triggerer_stall_threshold_sec,
                    self._stall_culprit,
                    _report_stall,
                    _warn_blocked,
                    on_lag=_loop_ran,
                )
                tasks.start_soon(watchdog.run)
                await self._consume(tasks)
        finally:
            for trigger_id, held in list(self.held.items()):
                if held.scope is None:  # task triggers say so themselves as they stop
                    self._log_cancelled(trigger_id, held)
            with anyio.CancelScope(shield=True):
                # Before the hand-off: a renewal after it would make the entries look fresh.
                await anyio.to_thread.run_sync(self.leases.close)
                self.lease_engine.dispose()
                await self._flush_outgoing()
                await self._store_task_logs()
                await self._hand_off()
                try:
                    await self._sync(self._register, liveness.STOPPED)
                except (RedisError, SQLAlchemyError) as exc:
                    log.warning("could not record the stop: %s", exc)
                self.broker.close()

    def _watchers(self) -> WatcherRunner:
        return WatcherRunner(
            self.sessions,
            self.cipher,
            self.name,
            self.settings.trigger_modules,
            self.settings.heartbeat_sec,
            self.settings.asset_watcher_max_queued,
        )

    def _lease_keeper(
        self,
        broker: Broker,
        loop: asyncio.AbstractEventLoop,
        beats_in: MemoryObjectSendStream[list[Lost]],
    ) -> LeaseKeeper:
        """The thread that renews this triggerer's leases and records its heartbeat, with its
        own Redis and Postgres connections; each beat, with what it found lost, is queued for the
        event loop without waiting for it (a blocked loop must not block the leases)."""
        # Bounded by a heartbeat: a database that hangs must not hold up the next renewal.
        self.lease_engine = make_engine(
            self.settings.database_url, pool_size=1, timeout_sec=self.settings.heartbeat_sec
        )
        sessions = make_sessionmaker(self.lease_engine)

        def on_beat(lost: list[Lost]) -> None:
            # RuntimeError: the loop has closed, the triggerer is stopping.
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(beats_in.send_nowait, lost)

        return LeaseKeeper(
            self.consumer,
            broker,
            heartbeat_sec=self.settings.heartbeat_sec,
            register=partial(self._register, liveness.RUNNING, sessions),
            on_beat=on_beat,
        )

    def _stall_culprit(self, task: asyncio.Task[Any] | None) -> RunningTrigger | str | None:
        """The trigger whose task is ``task``, else the task's name (the triggerer's own code),
        None outside any task (called from the watchdog thread)."""
        if task is None:
            return None
        return self.trigger_tasks.get(task) or task.get_name()

    def attach(self, broker: Broker) -> None:
        """Use ``broker`` (connected) for the triggers streams of the queues served."""
        self.broker = broker
        self.quarantine = Quarantine()  # one per process, over all its streams
        self.consumer = ConsumerSet(self._consumer_of, self._streams())

    def _streams(self) -> list[str]:
        """The triggers streams served: those of ``--queues``, else every one there is."""
        if self.queues is None:
            return self.broker.trigger_streams()
        return [stream for queue in self.queues for stream in self.keys.triggers_of(queue)]

    def _look_around(self) -> None:
        """Count the other live triggerers (a lone one reads at full speed) and, serving every
        queue, consume the triggers streams of queues that appeared since."""
        with self.sessions() as session:
            peers = session.scalar(
                select(func.count())
                .select_from(Triggerer)
                .where(
                    liveness.alive_clause(Triggerer, self.settings.heartbeat_sec),
                    Triggerer.name != self.name,
                )
            )
        if peers != self.peers:
            log.info("triggerer %s sees %d live peer(s)", self.name, peers)
            self.peers = peers
        if self.queues is None:
            for stream in self.consumer.join(self.broker.trigger_streams()):
                log.info("triggerer %s consuming %s too", self.name, stream)

    def _consumer_of(self, stream: str) -> StreamConsumer:
        return StreamConsumer(
            self.broker,
            stream,
            GROUP_TRIGGERERS,
            self.name,
            heartbeat_sec=self.settings.heartbeat_sec,
            max_deliveries=self.settings.max_deliveries,
            cipher=self.cipher,
            dead_letter_maxlen=self.settings.dead_letter_maxlen,
            owners=PostgresOwners(self.sessions, Triggerer),
            quarantine=self.quarantine,
            starts_on_admit=False,  # a timer runs no code of its own: _start_all says
        )

    async def _until_done(self, func: Any, *args: Any) -> None:
        """Call ``func`` until it succeeds, backing off while the servers are unavailable."""
        backoff = Backoff()
        while True:
            try:
                await self._sync(func, *args)
                return
            except Exception as exc:
                if not is_transient(exc):
                    raise
                log.warning("%s failed (%s); retrying", getattr(func, "__name__", func), exc)
                await anyio.sleep(backoff.next())

    async def _stop_on_signal(self, scope: anyio.CancelScope) -> None:
        with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async for signum in signals:
                log.info(
                    "received %s: cancelling %d trigger(s) (reason: shutdown)",
                    signal.Signals(signum).name,
                    len(self.held),
                )
                self.stopping.set()
                scope.cancel()
                return

    # -- reading entries -------------------------------------------------------------------------

    async def _consume(self, tasks: TaskGroup) -> None:
        backoff = Backoff()
        while True:
            free = self.capacity - len(self.held)
            if free <= 0:
                self.slot_freed = anyio.Event()
                await self.slot_freed.wait()
                continue
            try:
                # At most the claim per loop: replicas started together share a backlog.
                wanted = min(free, self.settings.triggerer_claim_per_loop)
                loop_started = time.monotonic()
                deliveries = await self._sync(self.consumer.poll, wanted, READ_BLOCK_MS)
            except Exception as exc:
                if not is_transient(exc):
                    raise
                # Redis restarting, or the stream or group lost: wait, recreate, read again.
                log.warning("reading the triggers streams failed: %s; retrying", exc)
                await anyio.sleep(backoff.next())
                await self._sync(_quietly, self.consumer.start)
                continue
            backoff.reset()
            await self._start_all(tasks, deliveries)
            if len(deliveries) >= wanted and self.peers != 0:
                await anyio.sleep(max(0.0, loop_started + CLAIM_LOOP_SEC - time.monotonic()))

    async def _start_all(self, tasks: TaskGroup, deliveries: list[Delivery]) -> None:
        started = []
        rejected: list[Rejected] = []
        runs: list[Run] = []
        opened = await self._open_all(deliveries, rejected)
        for delivery, spec, verdict in await self._check_all(opened):
            try:
                started.append(await self._start(delivery, spec, verdict, rejected, runs))
            except Exception as exc:
                self._not_started(delivery, exc)
        await self._reject(rejected)
        if runs:
            # The start evidence goes first: if one of these kills the triggerer, they are the
            # suspects (broker rule 31); a timer runs no code of its own and is none.
            try:
                await self._sync(self.consumer.starting, [run.delivery for run in runs])
            except Exception as exc:
                for run in runs:
                    self._release(run.held.trigger_id, run.held)
                    self._not_started(run.delivery, exc)
                runs = []
        for run in runs:
            # The task name is what the watchdog reports when this trigger blocks the loop.
            spec = run.decoded.spec
            name = f"trigger {spec.trigger_id} ({spec.classpath}) for {spec.task}"
            tasks.start_soon(self._run_trigger, run.held, run.decoded, name=name)
        self.owned += [tid for tid in started if tid is not None]

    def _not_started(self, delivery: Delivery, exc: Exception) -> None:
        """One entry never stops the triggerer: say so in one line and let it go (no longer
        renewed, it is taken over again after the takeover delay)."""
        log.error(
            "could not start %s entry %s: %s: %s",
            delivery.entry.stream,
            delivery.entry.id,
            type(exc).__name__,
            one_line(str(exc), MAX_DEAD_ERROR),
        )
        self.consumer.release([delivery.entry.id])

    async def _open_all(
        self, deliveries: list[Delivery], rejected: list[Rejected]
    ) -> list[tuple[Delivery, TriggerSpec]]:
        """The authenticated specs of the entries read; an entry whose token does not open as
        a trigger spec goes to ``rejected`` (failing no task: nothing proves it ours)."""
        opened = []
        emptied = []
        for delivery in deliveries:
            if not delivery.entry.fields:
                emptied.append(delivery.entry)  # deleted while pending
                continue
            try:
                opened.append((delivery, open_spec(delivery.entry, self.cipher)))
            except RejectedEntry as exc:
                rejected.append(Rejected(delivery, str(exc), None))
        if emptied:
            try:
                await self._sync(self.consumer.retire, emptied)
            except Exception as exc:  # retired at a later read; nothing else waits on it
                log.warning("could not retire %d emptied entries: %s", len(emptied), exc)
        return opened

    async def _check_all(
        self, opened: list[tuple[Delivery, TriggerSpec]]
    ) -> list[tuple[Delivery, TriggerSpec, SpecVerdict]]:
        """Each spec with its check against its trigger row in PostgreSQL, made in one
        statement. If that fails, none is returned: their entries are let go, taken over again
        later."""
        if not opened:
            return []
        try:
            rows = await self._sync(self._trigger_rows, [spec for _, spec in opened])
        except Exception as exc:
            log.warning(
                "could not check %d trigger entries against PostgreSQL: %s: %s; they are taken"
                " over again later",
                len(opened),
                type(exc).__name__,
                one_line(str(exc), MAX_DEAD_ERROR),
            )
            self.consumer.release([delivery.entry.id for delivery, _ in opened])
            return []
        return [
            (delivery, spec, spec_check(spec, row))
            for (delivery, spec), row in zip(opened, rows, strict=True)
        ]

    def _trigger_rows(self, specs: list[TriggerSpec]) -> list[TriggerRow]:
        with self.sessions() as session:
            return trigger_rows(session, specs)

    async def _start(
        self,
        delivery: Delivery,
        spec: TriggerSpec,
        verdict: SpecVerdict,
        rejected: list[Rejected],
        runs: list[Run],
    ) -> int | None:
        """Hold the trigger of an authenticated spec that passed its checks (``verdict``): a
        timer is started, one that runs goes to ``runs`` (started once their evidence is
        written), a bad one to ``rejected``."""
        entry = delivery.entry
        if verdict.refused is not None:
            reason = f"trigger {spec.trigger_id} refused: {verdict.refused}"
            rejected.append(Rejected(delivery, reason, None))
            return None
        if verdict.stale is not None:
            log.info("not starting %s entry %s: %s", entry.stream, entry.id, verdict.stale)
            await self._sync(self.consumer.retire, [entry])
            return None
        trigger_id = spec.trigger_id
        if self.consumer.exhausted(delivery):
            reason = f"trigger {trigger_id} {self.consumer.exhausted_reason(delivery)}"
            rejected.append(Rejected(delivery, reason, trigger_id))
            return None
        running = self.held.get(trigger_id)
        # A cancelled trigger still unwinding is not running: swapped in there, the newer entry
        # would stay held and renewed here once it ends, and never run (seen after a key wipe).
        if running is not None and not running.cancelled:
            if running.entry.id != entry.id:
                # A newer entry for a trigger running here (a republish): hold the newer one,
                # whose lease the peers see, and retire the older -- by the publisher, which
                # retries while Redis fails: a failure raised here would have the newer entry,
                # which the trigger now holds, released (taken over and run by a peer too).
                older, running.entry = running.entry, _slim(entry, trigger_id)
                self.outgoing.retiring.append(older)
                self.outgoing.ready.set()
            return None
        try:
            decoded = instantiate(entry, spec, self.settings.trigger_modules)
        except RejectedEntry as exc:
            rejected.append(Rejected(delivery, str(exc), exc.trigger_id if exc.authentic else None))
            return None
        moment = decoded.trigger.fires_at()
        held = Held(
            trigger_id,
            _slim(entry, trigger_id),
            None if moment is not None else anyio.CancelScope(),
            spec.task,
            spec.task_instance_id,
            spec.try_number,
            moment=moment,
        )
        if moment is not None:
            held.event = event_outcome(self.cipher, trigger_id, moment, self.name)
        self.held[trigger_id] = held
        log.info(
            "trigger %d (%s) for %s started on triggerer %s",
            trigger_id,
            spec.classpath,
            spec.task,
            self.name,
            extra=held.log_ids(),
        )
        if moment is not None:
            self.timers.add(held)
            return trigger_id
        runs.append(Run(delivery, held, decoded))
        return trigger_id

    async def _reject(self, rejected: Sequence[Rejected]) -> None:
        """Dead-letter entries (in one round trip: a flood of junk is read 50 at a time); for an
        authentic one (``fail_trigger``), also fail the task waiting on that trigger, with the
        reason, rather than leave it deferred."""
        if not rejected:
            return
        await self._sync(self.consumer.dead_letter_many, [(r.delivery, r.reason) for r in rejected])
        for r in rejected:
            if r.fail_trigger is not None:
                failure = failure_message(self.cipher, r.fail_trigger, r.reason, "", self.name)
                stream = self.keys.events_for(r.fail_trigger)
                await self._sync(self.broker.publish, stream, failure)

    # -- running triggers ------------------------------------------------------------------------

    async def _run_trigger(self, held: Held, decoded: Decoded) -> None:
        trigger, trigger_id = decoded.trigger, decoded.spec.trigger_id
        assert held.scope is not None
        # What the trigger's own code logs goes to the try's log (this task's context only).
        current_ids.set(held.log_ids()[LOG_IDS_ATTR])
        me = asyncio.current_task()
        if me is not None:
            self.trigger_tasks[me] = RunningTrigger(held, decoded.spec.classpath)
        published = False
        try:
            with held.scope:
                outcome = await self._first_event(trigger, held)
                self._send(held, masked(self.cipher, outcome, decoded.spec.kwargs))
                published = True  # the publisher frees the slot once it is out
            if held.scope.cancelled_caught:
                self._log_cancelled(trigger_id, held)
                if held.retire:
                    await self._retire(held, trigger)
        except anyio.get_cancelled_exc_class():
            self._log_cancelled(trigger_id, held)  # the whole triggerer is stopping
            raise
        except Exception as exc:
            # Never let one trigger take the event loop (and every other trigger) down, nor
            # leave its entry pending and renewed here for ever: unless it was cancelled (its
            # entry is a peer's, or its task moved on), its task fails saying why, and the
            # publisher retires the entry with that failure.
            log.exception(
                "trigger %d for %s: unexpected error", trigger_id, held.task, extra=held.log_ids()
            )
            if not published and not held.cancelled:
                self._send(held, self._failure(trigger_id, "failed unexpectedly with", exc))
                published = True
        finally:
            if me is not None:
                self.trigger_tasks.pop(me, None)
            if not published:
                self._release(trigger_id, held)

    def _release(self, trigger_id: int, held: Held) -> None:
        if self.held.get(trigger_id) is held:
            del self.held[trigger_id]
        self.slot_freed.set()

    def _timer_fired(self, held: Held) -> None:
        """A timer trigger's moment came: its event is the moment, as its run() would yield."""
        trigger_id = held.trigger_id
        if held.cancelled or self.held.get(trigger_id) is not held:
            return
        assert held.event is not None  # built when the timer was held (_start)
        self._send(held, held.event)

    def _failure(self, trigger_id: int, what: str, exc: BaseException) -> Outcome:
        return raised_outcome(self.cipher, self.name, trigger_id, what, exc)

    def _send(self, held: Held, outcome: Outcome) -> None:
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
        self.outgoing.items.append((held.trigger_id, held, message))
        self.outgoing.ready.set()

    def _cancel(self, trigger_id: int, held: Held, reason: str, *, retire: bool = False) -> None:
        """Stop a trigger (its task's cleanup runs in the task); ``retire`` also drops its
        entry, because its task no longer waits on it."""
        if held.cancelled:
            return
        held.cancelled, held.cancel_reason, held.retire = True, reason, retire
        if held.scope is not None:
            held.scope.cancel()
            return
        # A timer trigger runs nothing: forget it now (on_kill and cleanup are BaseTrigger's).
        if self.held.get(trigger_id) is held:
            self._log_cancelled(trigger_id, held)
            self._release(trigger_id, held)
            if retire:
                self.outgoing.retiring.append(held.entry)
                self.outgoing.ready.set()

    async def _publisher(self) -> None:
        """Publish fired events in batches: each event and the retirement of its entry in one
        Lua call, all of a batch in one round trip; retried while Redis fails (until published,
        an event exists only in this process)."""
        while True:
            await self.outgoing.ready.wait()
            await self._flush_outgoing()

    async def _flush_outgoing(self) -> None:
        backoff = Backoff()
        while self.outgoing.retiring:
            retiring = self.outgoing.retiring[:PUBLISH_BATCH]
            try:
                await self._sync(self.consumer.retire, retiring)
            except RedisError as exc:
                log.warning("retiring %d entr(ies) failed (%s); retrying", len(retiring), exc)
                await anyio.sleep(backoff.next())
                continue
            del self.outgoing.retiring[: len(retiring)]
        while self.outgoing.items:
            # Kept with their lines: a retry publishes the same.
            batch = await self._carry_task_logs(self.outgoing.items[:PUBLISH_BATCH])
            self.outgoing.items[: len(batch)] = batch
            items = [
                (held.entry, self.keys.events_beside(held.entry.stream), to_fields(message))
                for _, held, message in batch
            ]
            try:
                await self._sync(self.consumer.hand_on_many, items)
            except RedisError as exc:
                log.warning("publishing %d event(s) failed (%s); retrying", len(batch), exc)
                await anyio.sleep(backoff.next())
                continue
            del self.outgoing.items[: len(batch)]
            for trigger_id, held, message in batch:
                self._release(trigger_id, held)
                failed = message.kind == EVENT_KIND_FAILURE
                (metrics.TRIGGERS_FAILED if failed else metrics.TRIGGERS_FIRED).inc()
        self.outgoing.ready = anyio.Event()

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
        async with self.task_log_written:  # a batch being stored is stored first: lines in order
            split = tasklog.split_for_events(self.task_log.take(), pending)
            if split.rest:
                self.task_log.put_back(split.rest)
            await self._store(split.store_first)
        carrying = []
        for trigger_id, held, message in batch:
            carried = split.carried.pop((held.task_instance_id, held.try_number), None)
            if carried is not None and not message.log:
                message = with_log(self.cipher, message, carried)
            carrying.append((trigger_id, held, message))
        return carrying

    async def _retire(self, held: Held, trigger: BaseTrigger) -> None:
        """The task no longer waits on this trigger: run on_kill() if a user cancelled it, and
        drop the entry so nobody runs the trigger again (by the publisher, which retries while
        Redis fails: an entry left held would be renewed here for ever)."""
        with anyio.CancelScope(shield=True):
            if held.cancel_reason == decide.USER_ACTION:
                try:
                    await trigger.on_kill()
                except (Exception, SystemExit):
                    log.exception(
                        "on_kill() of the trigger for %s raised", held.task, extra=held.log_ids()
                    )
        self.outgoing.retiring.append(held.entry)
        self.outgoing.ready.set()

    @staticmethod
    def _log_cancelled(trigger_id: int, held: Held) -> None:
        metrics.TRIGGERS_CANCELLED.labels(held.cancel_reason).inc()
        log.info(
            "trigger %d for %s cancelled (reason: %s)",
            trigger_id,
            held.task,
            held.cancel_reason,
            extra=held.log_ids(),
        )

    async def _first_event(self, trigger: BaseTrigger, held: Held) -> Outcome:
        return await first_event(self.cipher, self.name, trigger, held.trigger_id, held.log_ids())

    # -- task logs -------------------------------------------------------------------------------

    async def _write_task_logs(self) -> None:
        while True:
            await anyio.sleep(TASK_LOG_INTERVAL_SEC)
            await self._store_task_logs()

    async def _store_task_logs(self) -> None:
        async with self.task_log_written:
            owned, self.owned = self.owned, []
            await self._store(self.task_log.take(), owned)

    async def _store(self, lines: list[NewLine], owned: Sequence[int] = ()) -> None:
        """Store lines about triggers in their tries' logs (the caller holds
        ``task_log_written``: batches are stored in order), and record this triggerer as the
        runner of the ``owned`` triggers, in one transaction; both are kept for the next batch
        while Postgres is unavailable (a log line never stops a trigger)."""
        if not lines and not owned:
            return
        try:
            await self._sync(self._store_lines, lines, owned)
        except SQLAlchemyError as exc:
            if not is_transient(exc):
                log.exception(
                    "dropped %d task log line(s) and the runner of %d trigger(s), which could"
                    " not be stored",
                    len(lines),
                    len(owned),
                )
                return
            self.task_log.put_back(lines)
            self.owned[:0] = owned
            log.warning(
                "could not store %d task log line(s) and the runner of %d trigger(s): %s",
                len(lines),
                len(owned),
                exc,
            )
        if self.task_log.dropped:
            log.warning(
                "dropped %d task log line(s) while they could not be stored",
                self.task_log.dropped,
            )
            self.task_log.dropped = 0

    def _store_lines(self, lines: list[NewLine], owned: Sequence[int] = ()) -> None:
        with self.sessions.begin() as session:
            if owned:
                # Only for people looking (triggers list, the task's page); a trigger that
                # already fired is gone and writes nothing. Before the lines: their try rows'
                # locks are taken last (tasklogs.append).
                session.execute(
                    text(
                        "UPDATE trigger SET triggerer_id = :name"
                        " WHERE id = ANY(CAST(:ids AS bigint[]))"
                    ),
                    {"name": self.name, "ids": list(owned)},
                )
            unknown = {line.task_instance_id for line in lines if line.try_number == 0}
            if unknown:
                # Entries from before tokens named the try: the task instance's try now.
                tries = {
                    ti_id: try_number
                    for ti_id, try_number in session.execute(
                        select(TaskInstance.id, TaskInstance.try_number).where(
                            TaskInstance.id.in_(unknown)
                        )
                    )
                }
                lines = [
                    line._replace(try_number=tries.get(line.task_instance_id, 0))
                    if line.try_number == 0
                    else line
                    for line in lines
                ]
            tasklogs.append(session, lines, self.settings.task_log_max_bytes)

    # -- leases ----------------------------------------------------------------------------------

    async def _after_beats(self, beats_out: MemoryObjectReceiveStream[list[Lost]]) -> None:
        """After each beat of the lease thread: stop the triggers whose entries it found taken
        over or gone, then those whose task no longer waits on them -- one after the other, as
        one beat did on the loop (their large transient lists never overlap: memory per held
        trigger). Beats that queued up while the loop was held are handled as one."""
        async for first in beats_out:
            lost = list(first)
            with contextlib.suppress(anyio.WouldBlock):
                while True:
                    lost += beats_out.receive_nowait()
            try:
                if lost:
                    await self._lost(lost)
                await self._drop_unwanted()
            except Exception as exc:
                if not is_transient(exc):
                    raise
                # Keep running: what was missed now is seen at the next beat.
                log.warning("the checks after a heartbeat failed: %s", exc)

    async def _take_overs(self, tasks: TaskGroup) -> None:
        """Run the triggers of entries whose owner stopped renewing them (a dead triggerer),
        looked for four times a heartbeat: taken soon after they pass the threshold."""
        while True:
            await anyio.sleep(self.settings.heartbeat_sec / 4)
            try:
                await self._sync(self._look_around)
                await self.take_over(tasks)
            except Exception as exc:
                if not is_transient(exc):
                    raise

    async def take_over(self, tasks: TaskGroup) -> None:
        """One look: claim batch after batch while batches come back full and capacity is left,
        so a dead peer's thousand entries move in one look, not a batch per look (several
        looks doubled failover.py's time to running again)."""
        while (free := self.capacity - len(self.held)) > 0:
            wanted = min(free, READ_BATCH)
            claimed = await self._sync(self.consumer.claim, wanted)
            if claimed:
                await self._start_all(tasks, claimed)
            if len(claimed) < wanted:
                return

    async def _lost(self, lost: list[Lost]) -> None:
        """Entries we no longer hold. One a peer took over: stop its trigger (reassigned). One
        that vanished was either retired by such a peer (Postgres then shows the task moved on,
        and the trigger is dropped on this beat), or lost with Redis's data: the trigger keeps
        running until the reconciler republishes its entry (which then replaces the lost one)
        -- unless a newer entry for it already exists, held elsewhere."""
        status = {item.entry_id: item.status for item in lost}
        affected = {tid: h for tid, h in self.held.items() if h.entry.id in status}
        for trigger_id, held in affected.items():
            if status[held.entry.id] is LeaseStatus.TAKEN:
                self._cancel(trigger_id, held, "reassigned")
        vanished: dict[str, list[str]] = {}
        for tid, h in affected.items():
            if status[h.entry.id] is LeaseStatus.GONE:
                vanished.setdefault(h.entry.stream, []).append(str(tid))
        for stream, trigger_ids in vanished.items():
            elsewhere = await self._sync(self.broker.present, stream, trigger_ids)
            for trigger_id, there in elsewhere.items():
                held = affected[int(trigger_id)]
                # The newer entry may have reached this triggerer during that call (a read
                # swaps it in, see _start): then the trigger holds it and goes on here.
                if there and held.entry.id in status:
                    self._cancel(int(trigger_id), held, "reassigned")

    async def _drop_unwanted(self) -> None:
        """Cancel the triggers whose task no longer waits on them (timed out, cleared, marked).
        The check runs in a thread, a set-based query whatever the number held: only the few
        unwanted ones come back to the event loop."""
        if not self.held:
            return
        # Two lists of ints, not a tuple per trigger: a hundred thousand new tuples living
        # across the await would be promoted and set off a full garbage collection each beat,
        # which held the event loop (triggerer_density.py's lag).
        trigger_ids = list(self.held)
        ti_ids = [h.task_instance_id for h in self.held.values()]
        unwanted = await anyio.to_thread.run_sync(self._unwanted, trigger_ids, ti_ids)
        for trigger_id, reason in unwanted.items():
            item = self.held.get(trigger_id)
            if item is not None:
                self._cancel(trigger_id, item, reason, retire=True)

    def _unwanted(self, trigger_ids: list[int], ti_ids: list[int]) -> dict[int, str]:
        """Of the triggers held (for the task instances at the same positions), those no task
        waits on any more, with why (see decide.cancel_reason)."""
        with self.sessions() as session:
            wanted = set(
                session.scalars(
                    text(
                        "SELECT held.trigger_id FROM unnest(CAST(:triggers AS bigint[]),"
                        " CAST(:tis AS bigint[])) AS held(trigger_id, ti_id)"
                        " JOIN task_instance ti ON ti.id = held.ti_id"
                        " WHERE ti.state = 'deferred' AND ti.trigger_id = held.trigger_id"
                    ),
                    # As array literals: psycopg dumps a list one element at a time in Python,
                    # holding the GIL far longer than the join itself takes.
                    {"triggers": _array(trigger_ids), "tis": _array(ti_ids)},
                )
            )
            gone = {t: i for t, i in zip(trigger_ids, ti_ids, strict=True) if t not in wanted}
            if gone:
                # A shared trigger is wanted while any task waits on it, not only the one it
                # was started for: asked of the few that look gone, not of every trigger held.
                waited = self._waited_on(session, gone)
                gone = {t: i for t, i in gone.items() if t not in waited}
            if not gone:
                return {}
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
            now = {
                row[0]: (row[1], row[2], row[3])
                for row in session.execute(
                    select(
                        TaskInstance.id, TaskInstance.state, TaskInstance.trigger_id, left_deferred
                    ).where(TaskInstance.id.in_(set(gone.values())))
                )
            }
        reasons = {}
        for trigger_id, ti_id in gone.items():
            state, ti_trigger_id, reason_text = now.get(ti_id, (None, None, None))
            reason = decide.cancel_reason(trigger_id, state, ti_trigger_id, reason_text)
            if reason is not None:
                reasons[trigger_id] = reason
        return reasons

    @staticmethod
    def _waited_on(session: Session, trigger_ids: Collection[int]) -> set[int]:
        """Those of ``trigger_ids`` some deferred task still waits on."""
        return set(
            session.scalars(
                text(
                    "SELECT DISTINCT trigger_id FROM task_instance WHERE state = 'deferred'"
                    " AND trigger_id = ANY(CAST(:triggers AS bigint[]))"
                ),
                {"triggers": _array(list(trigger_ids))},
            )
        )

    async def _hand_off(self) -> None:
        """On the way out, make our entries look long idle so that peers take them at once
        instead of after the takeover delay."""
        try:
            handed = await self._sync(self.consumer.hand_off)
        except RedisError as exc:
            log.warning("could not hand off entries: %s (peers take them after the delay)", exc)
            return
        if handed:
            log.info("handed off %d trigger entr(ies)", handed)

    # -- bookkeeping in Postgres (for the CLI and doctor) ----------------------------------------

    def _register(self, state: str, sessions: sessionmaker[Session] | None = None) -> None:
        values: dict[str, Any] = {
            "name": self.name,
            "hostname": socket.gethostname(),
            "pid": os.getpid(),
            "capacity": self.capacity,
            "queues": recorded(self.queues),
            "load": len(self.held),
            "state": state,
        }
        with (sessions or self.sessions).begin() as session:
            liveness.heartbeat(session, Triggerer, values)


def _quietly(func: Any) -> None:
    try:
        func()
    except Exception as exc:
        if not is_transient(exc):
            raise


def _culprit_named(culprit: RunningTrigger | str | None) -> tuple[str, LogExtra]:
    if culprit is None:
        return "code outside any task", {}
    if isinstance(culprit, str):
        return f"task {culprit!r} (no trigger)", {}
    held = culprit.held
    name = f"trigger {held.trigger_id} ({culprit.classpath}) for {held.task}"
    return name, held.log_ids()


def _loop_ran(lag_sec: float) -> None:
    """The watchdog's timer ran: the loop moves (and was ``lag_sec`` late)."""
    metrics.LOOP_LAG.observe(lag_sec)
    metrics.LOOP_ITERATION.set_to_current_time()


def _report_stall(culprit: RunningTrigger | str | None, stack: str) -> None:
    """The loop has not moved for the stall threshold: say who holds it and where, while it
    still does (called from the watchdog thread)."""
    metrics.LOOP_STALLS.inc()
    metrics.BLOCKED_LOOP_WARNINGS.inc()
    name, extra = _culprit_named(culprit)
    log.warning(
        "event loop stalled: %s is holding it in synchronous code; its stack:\n%s",
        name,
        stack,
        extra=extra,
    )


def _warn_blocked(culprit: RunningTrigger | str | None, seconds: float) -> None:
    name, extra = _culprit_named(culprit)
    log.warning(
        "%s blocked the event loop for %.2f s: move blocking calls off the loop "
        "(anyio.to_thread.run_sync)",
        name,
        seconds,
        extra=extra,
    )
