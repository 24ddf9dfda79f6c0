"""Starting the triggers of the entries read or taken over: each entry's spec authenticated and
checked against its trigger row (all in one statement), then held -- a timer on the shared
timer, one that runs started as a task once the start evidence of all of them is written
(broker rule 31). A bad entry is dead-lettered, failing its task if it is authentic; one entry
never stops the triggerer."""

from __future__ import annotations

import logging
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any

import anyio
import anyio.lowlevel
from anyio.abc import TaskGroup
from sqlalchemy.orm import Session, sessionmaker

from broker.client import Broker
from broker.consumer import Delivery
from broker.consumers import ConsumerSet
from broker.service import poisoned
from broker.streams import MAX_DEAD_ERROR, StreamKeys, TriggerSpec, one_line
from broker.trigger_rows import SpecVerdict, TriggerRow, spec_check, trigger_rows
from deferral.runtime.crypto import Cipher
from deferral.runtime.outages import OUTAGE
from triggerer.decode import Decoded, RejectedEntry, instantiate, open_spec
from triggerer.events import failure_message
from triggerer.held import Held, in_thread
from triggerer.holding import HeldTriggers
from triggerer.logstore import TaskLogStore
from triggerer.publisher import Publisher
from triggerer.timers import Timers

log = logging.getLogger("deferral.triggerer")

# What the triggerer says of each trigger it starts (its try's log, and its own log but for timers
# moved here by the thousand).
STARTED = "trigger %d (%s) for %s started on triggerer %s"
# Entries opened or started between two checkpoints of the event loop (a takeover hands over a
# thousand at a time).
START_BATCH = 250


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


class Starter:
    def __init__(
        self,
        *,
        name: str,
        sessions: sessionmaker[Session],
        cipher: Cipher,
        keys: StreamKeys,
        broker: Broker,
        consumer: ConsumerSet,
        trigger_modules: Sequence[str],
        held: HeldTriggers,
        timers: Timers,
        publisher: Publisher,
        task_logs: TaskLogStore,
        release: Callable[[int, Held], None],
        run_trigger: Callable[[Held, Decoded], Coroutine[Any, Any, None]],
    ) -> None:
        self.name = name
        self.sessions = sessions
        self.cipher = cipher
        self.keys = keys
        self.broker = broker
        self.consumer = consumer
        self.trigger_modules = trigger_modules
        self.held = held  # the service's: the triggers held, by id
        self.timers = timers
        self.publisher = publisher
        self.task_logs = task_logs  # records this triggerer as the runner of those started
        self.release = release
        self.run_trigger = run_trigger

    async def start_all(self, tasks: TaskGroup, deliveries: list[Delivery]) -> None:
        started = []
        rejected: list[Rejected] = []
        runs: list[Run] = []
        moved: dict[str, int] = {}  # timers held before (takeover, replay), by their holder
        opened = await self._open_all(deliveries, rejected)
        for n, (delivery, spec, verdict) in enumerate(await self._check_all(opened), 1):
            try:
                started.append(await self._start(delivery, spec, verdict, rejected, runs, moved))
            except Exception as exc:
                self._not_started(delivery, exc)
            if n % START_BATCH == 0:  # a takeover's thousand: the timers and publisher run
                await anyio.lowlevel.checkpoint()
        for holder, count in moved.items():
            log.info(
                "%d timer trigger(s) held by %s started on triggerer %s (each named in its try's"
                " log)",
                count,
                holder,
                self.name,
            )
        await self._reject(rejected)
        if runs:
            # The start evidence goes first: if one of these kills the triggerer, they are the
            # suspects (broker rule 31); a timer runs no code of its own and is none.
            try:
                await in_thread(self.consumer.starting, [run.delivery for run in runs])
            except Exception as exc:
                for run in runs:
                    self.release(run.held.trigger_id, run.held)
                    self._not_started(run.delivery, exc)
                runs = []
        for run in runs:
            # The task name is what the watchdog reports when this trigger blocks the loop.
            spec = run.decoded.spec
            name = f"trigger {spec.trigger_id} ({spec.classpath}) for {spec.task}"
            tasks.start_soon(self.run_trigger, run.held, run.decoded, name=name)
        self.task_logs.owned += [tid for tid in started if tid is not None]

    def _not_started(self, delivery: Delivery, exc: Exception) -> None:
        """One entry never stops the triggerer: say so in one line and let it go (no longer
        renewed, it is taken over again after the takeover delay). Redis failing is no fault of
        the entry: said by the process's account of it."""
        if not OUTAGE.redis_failed(exc, f"starting {delivery.entry.stream} {delivery.entry.id}"):
            log.error(
                "could not start %s entry %s: %s: %s",
                delivery.entry.stream,
                delivery.entry.id,
                type(exc).__name__,
                one_line(str(exc), MAX_DEAD_ERROR),
            )
        self.consumer.release([delivery.entry])

    async def _open_all(
        self, deliveries: list[Delivery], rejected: list[Rejected]
    ) -> list[tuple[Delivery, TriggerSpec]]:
        """The authenticated specs of the entries read; an entry whose token does not open as
        a trigger spec goes to ``rejected`` (failing no task: nothing proves it ours)."""
        opened = []
        emptied = []
        for n, delivery in enumerate(deliveries, 1):
            if n % START_BATCH == 0:
                await anyio.lowlevel.checkpoint()
            if not delivery.entry.fields:
                emptied.append(delivery.entry)  # deleted while pending
                continue
            try:
                opened.append((delivery, open_spec(delivery.entry, self.cipher)))
            except RejectedEntry as exc:
                rejected.append(Rejected(delivery, str(exc), None))
        if emptied:
            try:
                await in_thread(self.consumer.retire, emptied)
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
            rows = await in_thread(self._trigger_rows, [spec for _, spec in opened])
        except Exception as exc:
            log.warning(
                "could not check %d trigger entries against PostgreSQL: %s: %s; they are taken"
                " over again later",
                len(opened),
                type(exc).__name__,
                one_line(str(exc), MAX_DEAD_ERROR),
            )
            self.consumer.release([delivery.entry for delivery, _ in opened])
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
        moved: dict[str, int],
    ) -> int | None:
        """Hold the trigger of an authenticated spec that passed its checks (``verdict``): a
        timer is started (counted in ``moved`` by where it comes from, if it was held before),
        one that runs goes to ``runs`` (started once their evidence is written), a bad one to
        ``rejected``."""
        entry = delivery.entry
        if verdict.refused is not None:
            reason = f"trigger {spec.trigger_id} refused: {verdict.refused}"
            rejected.append(Rejected(delivery, reason, None))
            return None
        if verdict.stale is not None:
            log.info("not starting %s entry %s: %s", entry.stream, entry.id, verdict.stale)
            await in_thread(self.consumer.retire, [entry])
            return None
        trigger_id = spec.trigger_id
        poison = poisoned(self.consumer, delivery, f"trigger {trigger_id}")
        if poison is not None:
            rejected.append(Rejected(delivery, poison, trigger_id))
            return None
        running = self.held.get(trigger_id)
        # A cancelled trigger still unwinding is not running: swapped in there, the newer entry
        # would stay held and renewed here once it ends, and never run (seen after a key wipe).
        if running is not None and not running.cancelled:
            if running.key != entry.key:
                # A newer entry for a trigger running here (a republish): hold the newer one,
                # whose lease the peers see, and retire the older -- by the publisher, which
                # retries while Redis fails: a failure raised here would have the newer entry,
                # which the trigger now holds, released (taken over and run by a peer too).
                older, running.entry = running.entry, entry
                self.publisher.retire(older)
            return None
        try:
            decoded = instantiate(entry, spec, self.trigger_modules)
        except RejectedEntry as exc:
            rejected.append(Rejected(delivery, str(exc), exc.trigger_id if exc.authentic else None))
            return None
        moment = decoded.trigger.fires_at()
        held = Held(
            trigger_id,
            entry,
            None if moment is not None else anyio.CancelScope(),
            spec.task,
            spec.task_instance_id,
            spec.try_number,
            moment=moment,
        )
        self.held[trigger_id] = held
        args = (trigger_id, spec.classpath, spec.task, self.name)
        if moment is not None and delivery.taken_from is not None:
            # A timer moved here (a takeover or a replay, a thousand at a time): its line goes
            # to its try's log only, and the batch gets one line here (start_all); a line each
            # through every handler was half of what moving a hundred thousand cost.
            self.task_logs.handler.said(
                held.task_instance_id, held.try_number, log.name, STARTED % args
            )
            moved[delivery.taken_from] = moved.get(delivery.taken_from, 0) + 1
        else:
            log.info(STARTED, *args, extra=held.log_ids())
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
        await in_thread(self.consumer.dead_letter_many, [(r.delivery, r.reason) for r in rejected])
        for r in rejected:
            if r.fail_trigger is not None:
                failure = failure_message(self.cipher, r.fail_trigger, r.reason, "", self.name)
                stream = self.keys.events_for(r.fail_trigger)
                await in_thread(self.broker.publish, stream, failure)
