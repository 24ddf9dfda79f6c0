"""Running the triggers held: each trigger's ``run()`` as a task of its own (a timer waits on the
shared timer instead) until its first event, which goes to the publisher (as does each progress
it reports before); cancelling one
(shutdown, reassigned, timeout, user_action, superseded), with its ``on_kill()`` when a user
cancelled it. No trigger takes the event loop, or any other trigger, down with it."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import anyio

from deferral.runtime import metrics
from deferral.runtime.crypto import Cipher
from deferral.runtime.process import LOG_IDS_ATTR
from deferral.triggers.base import BaseTrigger
from triggerer import decide
from triggerer.decode import Decoded
from triggerer.events import Outcome, event_outcome, first_event, masked, raised_outcome
from triggerer.held import Held, RunningTrigger
from triggerer.holding import HeldTriggers
from triggerer.publisher import Publisher
from triggerer.tasklog import current_ids

log = logging.getLogger("deferral.triggerer")


class Runner:
    def __init__(
        self,
        *,
        name: str,
        cipher: Cipher,
        held: HeldTriggers,
        trigger_tasks: dict[asyncio.Task[Any], RunningTrigger],
        publisher: Publisher,
        release: Callable[[int, Held], None],
    ) -> None:
        self.name = name
        self.cipher = cipher
        self.held = held  # the service's: the triggers held, by id
        self.trigger_tasks = trigger_tasks  # the service's: for the watchdog to name a culprit
        self.publisher = publisher
        self.release = release
        # The events of the timers due within timers.SEAL_AHEAD, sealed (only those: sealed as
        # each timer was held, they cost ~0.75 KB a timer).
        self.sealed: dict[Held, Outcome] = {}

    async def run(self, held: Held, decoded: Decoded) -> None:
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
                outcome = await first_event(
                    self.cipher,
                    self.name,
                    trigger,
                    held.trigger_id,
                    held.log_ids(),
                    lambda payload: self.publisher.progress(held, payload, decoded.spec.kwargs),
                )
                self.publisher.send(held, masked(self.cipher, outcome, decoded.spec.kwargs))
                published = True  # the publisher frees the slot once it is out
            if held.scope.cancelled_caught:
                log_cancelled(trigger_id, held)
                if held.retire:
                    await self._retire(held, trigger)
        except anyio.get_cancelled_exc_class():
            log_cancelled(trigger_id, held)  # the whole triggerer is stopping
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
                failure = self._failure(trigger_id, "failed unexpectedly with", exc)
                self.publisher.send(held, failure)
                published = True
        finally:
            if me is not None:
                self.trigger_tasks.pop(me, None)
            if not published:
                self.release(trigger_id, held)

    def seal_timer(self, held: Held) -> None:
        """A timer trigger's moment is near: seal its event now, so that at the moment it is
        only logged and published. Its event is the moment, as its run() would yield."""
        if held.moment is None or held.cancelled or self.held.get(held.trigger_id) is not held:
            return
        self.sealed[held] = event_outcome(self.cipher, held.trigger_id, held.moment, self.name)

    def timer_fired(self, held: Held) -> None:
        """A timer trigger's moment came: publish its event (sealed a little before)."""
        if held.cancelled or self.held.get(held.trigger_id) is not held:
            return
        if held not in self.sealed:  # held after its sealing time (a takeover of late timers)
            self.seal_timer(held)
        self.publisher.send(held, self.sealed.pop(held))

    def _failure(self, trigger_id: int, what: str, exc: BaseException) -> Outcome:
        return raised_outcome(self.cipher, self.name, trigger_id, what, exc)

    def cancel(self, trigger_id: int, held: Held, reason: str, *, retire: bool = False) -> None:
        """Stop a trigger (its task's cleanup runs in the task); ``retire`` also drops its
        entry, because its task no longer waits on it."""
        if held.cancelled:
            return
        held.cancelled, held.cancel_reason, held.retire = True, reason, retire
        if held.scope is not None:
            held.scope.cancel()
            return
        # A timer trigger runs nothing: forget it now (on_kill and cleanup are BaseTrigger's).
        self.sealed.pop(held, None)
        if self.held.get(trigger_id) is held:
            log_cancelled(trigger_id, held)
            self.release(trigger_id, held)
            if retire:
                self.publisher.retire(held.entry)

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
        self.publisher.retire(held.entry)


def log_cancelled(trigger_id: int, held: Held) -> None:
    metrics.TRIGGERS_CANCELLED.labels(held.cancel_reason).inc()
    log.info(
        "trigger %d for %s cancelled (reason: %s)",
        trigger_id,
        held.task,
        held.cancel_reason,
        extra=held.log_ids(),
    )
