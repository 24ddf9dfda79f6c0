"""A trigger this triggerer holds (:class:`Held`), and the blocking calls its event loop makes in
threads (:func:`in_thread`)."""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any, TypeVar

import anyio
import anyio.to_thread

from broker.replies import Entry
from deferral.runtime.process import LogExtra, log_ids
from triggerer.events import Outcome

T = TypeVar("T")


async def in_thread(func: Callable[..., T], *args: Any) -> T:
    """``func(*args)`` in a worker thread, which a cancelled caller still waits for."""
    return await anyio.to_thread.run_sync(partial(func, *args), abandon_on_cancel=False)


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


@dataclass(frozen=True, slots=True)
class RunningTrigger:
    """Who an asyncio task running a trigger's ``run()`` is: what a stall report names."""

    held: Held
    classpath: str


def slim(entry: Entry, trigger_id: int) -> Entry:
    # Keep what retiring needs (the index field), not the token: memory per held trigger.
    return Entry(entry.stream, entry.id, {b"trigger_id": str(trigger_id).encode()})
