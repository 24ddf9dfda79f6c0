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
import logging
import math
import signal
import threading
import time
from collections.abc import Sequence
from functools import partial
from typing import Any

import anyio
import anyio.to_thread
from anyio.abc import TaskGroup
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream
from sqlalchemy import func, select

from broker.client import Broker, LeaseStatus, connect_when_up
from broker.consumer import Backoff, Lost
from broker.consumers import ConsumerSet
from broker.owners import PostgresOwners
from broker.service import Registration, connect, consumer_set, hand_off
from broker.streams import GROUP_TRIGGERERS, StreamKeys
from deferral.loading.dagbag import put_on_sys_path
from deferral.runtime import metrics
from deferral.runtime.config import Settings
from deferral.runtime.crypto import Cipher
from deferral.runtime.faults import is_transient
from deferral.runtime.outages import OUTAGE, settle_over_heartbeats
from deferral.runtime.process import LogExtra, freeze_startup_objects
from deferral.store import liveness
from deferral.store.db import make_engine, make_sessionmaker
from deferral.store.queues import recorded
from deferral.store.tables import Triggerer
from triggerer import decide
from triggerer.held import Held, RunningTrigger, in_thread
from triggerer.holding import HeldTriggers
from triggerer.leases import LeaseKeeper
from triggerer.logstore import TaskLogStore
from triggerer.publisher import Publisher
from triggerer.running import Runner, log_cancelled
from triggerer.starting import Starter
from triggerer.timers import Timers
from triggerer.unwanted import unwanted
from triggerer.watchdog import LoopWatchdog
from triggerer.watchers import WatcherRunner

log = logging.getLogger("deferral.triggerer")

# Entries taken over, or replayed after a restart, per claim at most (new ones are read
# DEFERRAL_TRIGGERER_CLAIM_PER_LOOP at a time, so one replica never drains the stream its peers
# share): a dead peer's or a restarted name's hundred thousand timers move in batches whose
# fixed cost (round trips, the row check, thread hops) is spread over many (100 at a time, it
# was most of a failover's time: benchmarks/README.md).
READ_BATCH = 1000
# The shortest loop that read a whole DEFERRAL_TRIGGERER_CLAIM_PER_LOOP while another triggerer
# is alive: one that finds a backlog takes its share and leaves its peers theirs, whatever its
# CPU share (at most 500 new triggers a second at the default claim; a raised claim raises it).
# A triggerer alone reads at full speed.
CLAIM_LOOP_SEC = 0.1
# An idle read waits this long for entries. A SIGTERM waits for the read in flight (a thread
# cannot be interrupted), so this bounds how soon a stopping triggerer hands off and exits.
READ_BLOCK_MS = 250


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
        self.registration = Registration(
            self.sessions,
            Triggerer,
            name,
            lambda: {
                "capacity": self.capacity,
                "queues": recorded(self.queues),
                "load": len(self.held),
            },
        )
        self.held = HeldTriggers()
        self.slot_freed = anyio.Event()
        self.timers = Timers(self.held)
        self.stopping = threading.Event()  # for waits in threads (servers down at start)
        self.task_logs = TaskLogStore(self.sessions, name, settings.task_log_max_bytes)
        # The tasks running triggers' run(), for the watchdog thread to name a stall's culprit.
        self.trigger_tasks: dict[asyncio.Task[Any], RunningTrigger] = {}
        self.broker: Broker
        self.consumer: ConsumerSet
        self.publisher: Publisher
        self.runner: Runner
        self.starter: Starter
        self.leases: LeaseKeeper | None = None
        self.peers: int | None = None  # other live triggerers (None: not counted yet)
        metrics.TRIGGERS_RUNNING.set_function(lambda: len(self.held))
        metrics.TRIGGERER_CAPACITY_LEFT.set_function(lambda: self.capacity - len(self.held))

    async def run(self) -> None:
        settle_over_heartbeats(self.settings.heartbeat_sec)
        root = logging.getLogger()
        root.addHandler(self.task_logs.handler)
        try:
            async with anyio.create_task_group() as tasks:
                tasks.start_soon(self._stop_on_signal, tasks.cancel_scope)
                await self._serve(tasks)
                tasks.cancel_scope.cancel()
        except* SystemExit as exits:  # a Redis it cannot use (connect_when_up): its one line
            raise exits.exceptions[0] from None
        finally:
            root.removeHandler(self.task_logs.handler)
        log.info("triggerer %s stopped", self.name)

    async def _serve(self, outer: TaskGroup) -> None:
        broker = await anyio.to_thread.run_sync(connect, self.settings, self.engine, self.stopping)
        if broker is None:
            return
        self.attach(broker)
        await self._until_done(self.consumer.start)
        await self._until_done(self.registration.record, liveness.RUNNING)
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
                tasks.start_soon(self.publisher.run)
                tasks.start_soon(self.timers.run, self.runner.timer_fired, self.runner.seal_timer)
                tasks.start_soon(self.task_logs.run)
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
            for held in self.held.timers():  # task triggers say so themselves as they stop
                log_cancelled(held.trigger_id, held)
            with anyio.CancelScope(shield=True):
                # Before the hand-off: a renewal after it would make the entries look fresh.
                await anyio.to_thread.run_sync(self.leases.close)
                self.lease_engine.dispose()
                await self.publisher.flush()
                await self.task_logs.store_all()
                await in_thread(hand_off, self.consumer, "trigger entr(ies)")
                await in_thread(self.registration.record_stop)
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
            register=partial(self.registration.record, liveness.RUNNING, sessions),
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
        self.consumer = consumer_set(
            broker,
            self._streams(),
            group=GROUP_TRIGGERERS,
            name=self.name,
            settings=self.settings,
            cipher=self.cipher,
            owners=PostgresOwners(self.sessions, Triggerer),
            starts_on_admit=False,  # a timer runs no code of its own: the starter says
        )
        self.publisher = Publisher(
            broker, self.consumer, self.keys, self.cipher, self.task_logs, self._release, self.name
        )
        self.runner = Runner(
            name=self.name,
            cipher=self.cipher,
            held=self.held,
            trigger_tasks=self.trigger_tasks,
            publisher=self.publisher,
            release=self._release,
        )
        self.starter = Starter(
            name=self.name,
            sessions=self.sessions,
            cipher=self.cipher,
            keys=self.keys,
            broker=broker,
            consumer=self.consumer,
            trigger_modules=self.settings.trigger_modules,
            held=self.held,
            timers=self.timers,
            publisher=self.publisher,
            task_logs=self.task_logs,
            release=self._release,
            run_trigger=self.runner.run,
        )

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

    async def _until_done(self, func: Any, *args: Any) -> None:
        """Call ``func`` until it succeeds, backing off while the servers are unavailable."""
        backoff = Backoff()
        while True:
            try:
                await in_thread(func, *args)
                return
            except Exception as exc:
                if not is_transient(exc):
                    raise
                OUTAGE.failed(exc, getattr(func, "__name__", str(func)))
                await anyio.sleep(backoff.next())

    async def _stop_on_signal(self, scope: anyio.CancelScope) -> None:
        with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async for signum in signals:
                # Named as the scheduler's and worker's lines are (process.stop_on_signals).
                log.info(
                    "triggerer %s: received %s, stopping: cancelling %d trigger(s)"
                    " (reason: shutdown)",
                    self.name,
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
                # At most the claim per loop: replicas started together share a backlog. Our
                # own pending entries (a restart) are no one else's share: a batch at a time.
                replaying = self.consumer.replaying
                claim = READ_BATCH if replaying else self.settings.triggerer_claim_per_loop
                wanted = min(free, claim)
                loop_started = time.monotonic()
                deliveries = await in_thread(self.consumer.poll, wanted, READ_BLOCK_MS)
            except Exception as exc:
                if not is_transient(exc):
                    raise
                # Redis restarting, or the stream or group lost: wait, recreate, read again.
                OUTAGE.failed(exc, "reading the triggers streams")
                await anyio.sleep(backoff.next())
                await in_thread(_quietly, self.consumer.start)
                continue
            OUTAGE.reached()
            backoff.reset()
            await self.starter.start_all(tasks, deliveries)
            if len(deliveries) >= wanted and self.peers != 0 and not replaying:
                await anyio.sleep(max(0.0, loop_started + CLAIM_LOOP_SEC - time.monotonic()))

    # -- running triggers ------------------------------------------------------------------------

    def _release(self, trigger_id: int, held: Held) -> None:
        if self.held.get(trigger_id) is held:
            del self.held[trigger_id]
        self.slot_freed.set()

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
                OUTAGE.failed(exc, "the checks after a heartbeat")

    async def _take_overs(self, tasks: TaskGroup) -> None:
        """Run the triggers of entries whose owner stopped renewing them (a dead triggerer) or
        handed them off (a stopping one), looked for as often as ``decide.takeover_every``
        says; the peers are counted four times a heartbeat."""
        every = decide.takeover_every(self.settings.heartbeat_sec)
        looked_around = 0.0
        while True:
            await anyio.sleep(every)
            try:
                if anyio.current_time() - looked_around >= self.settings.heartbeat_sec / 4:
                    await in_thread(self._look_around)
                    looked_around = anyio.current_time()
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
            claimed = await in_thread(self.consumer.claim, wanted)
            if claimed:
                await self.starter.start_all(tasks, claimed)
            if len(claimed) < wanted:
                return

    async def _lost(self, lost: list[Lost]) -> None:
        """Entries we no longer hold. One a peer took over: stop its trigger (reassigned). One
        that vanished was either retired by such a peer (Postgres then shows the task moved on,
        and the trigger is dropped on this beat), or lost with Redis's data: the trigger keeps
        running until the reconciler republishes its entry (which then replaces the lost one)
        -- unless a newer entry for it already exists, held elsewhere."""
        status = {item.key: item.status for item in lost}
        affected = self.held.keyed(status)
        for trigger_id, held in affected.items():
            if status[held.key] is LeaseStatus.TAKEN:
                self.runner.cancel(trigger_id, held, "reassigned")
        vanished: dict[str, list[str]] = {}
        for tid, h in affected.items():
            if status[h.key] is LeaseStatus.GONE:
                vanished.setdefault(h.stream, []).append(str(tid))
        for stream, trigger_ids in vanished.items():
            elsewhere = await in_thread(self.broker.present, stream, trigger_ids)
            for named, there in elsewhere.items():
                held = affected[int(named)]
                # The newer entry may have reached this triggerer during that call (a read
                # swaps it in, see Starter._start): then the trigger holds it and goes on here.
                if there and held.key in status:
                    self.runner.cancel(int(named), held, "reassigned")

    async def _drop_unwanted(self) -> None:
        """Cancel the triggers whose task no longer waits on them (timed out, cleared, marked).
        The check runs in a thread, a set-based query whatever the number held: only the few
        unwanted ones come back to the event loop."""
        if not self.held:
            return
        # Two lists of ints, not a tuple per trigger: a hundred thousand new tuples living
        # across the await would be promoted and set off a full garbage collection each beat,
        # which held the event loop (triggerer_density.py's lag). Dozing timers stay dozing.
        trigger_ids, ti_ids = self.held.task_instances()
        unwanted_now = await anyio.to_thread.run_sync(unwanted, self.sessions, trigger_ids, ti_ids)
        for trigger_id, reason in unwanted_now.items():
            item = self.held.get(trigger_id)
            if item is not None:
                self.runner.cancel(trigger_id, item, reason, retire=True)


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
