"""A trigger this triggerer holds (:class:`Held`), and the blocking calls its event loop makes in
threads (:func:`in_thread`)."""

from __future__ import annotations

import datetime as dt
import sys
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any, TypeVar

import anyio
import anyio.to_thread

from broker.replies import Entry
from deferral.runtime.process import LogExtra, log_ids

T = TypeVar("T")


async def in_thread(func: Callable[..., T], *args: Any) -> T:
    """``func(*args)`` in a worker thread, which a cancelled caller still waits for."""
    return await anyio.to_thread.run_sync(partial(func, *args), abandon_on_cancel=False)


@dataclass(eq=False, slots=True, init=False)
class Held:
    """A trigger this triggerer runs, the stream entry it holds a lease on (its stream and id
    only: memory per held trigger, see :attr:`entry`), and, once it is cancelled, why
    (shutdown, reassigned, timeout, user_action, superseded). A trigger that only waits for a
    moment has no task (``scope`` None): it waits on the shared timer, at ``moment``."""

    trigger_id: int
    stream: str
    entry_id: str
    scope: anyio.CancelScope | None
    task: str
    task_instance_id: int
    # The try that deferred on it (0: unknown, an older entry), whose log the lines go to.
    try_number: int
    moment: dt.datetime | None
    # Why it was cancelled (shutdown, reassigned, ...); None while it is not.
    why: str | None
    # Cancelled because its task no longer waits on it: retire the entry too.
    retire: bool

    def __init__(
        self,
        trigger_id: int,
        entry: Entry,
        scope: anyio.CancelScope | None,
        task: str,
        task_instance_id: int,
        try_number: int,
        moment: dt.datetime | None = None,
    ) -> None:
        self.trigger_id = trigger_id
        self.entry = entry
        self.scope = scope
        self.task = task
        self.task_instance_id = task_instance_id
        self.try_number = try_number
        self.moment = moment
        self.why = None
        self.retire = False

    @property
    def cancelled(self) -> bool:
        return self.why is not None

    @cancelled.setter
    def cancelled(self, cancelled: bool) -> None:
        self.why = (self.why or "shutdown") if cancelled else None

    @property
    def cancel_reason(self) -> str:
        """Why it was cancelled; a trigger stopped with the whole triggerer was never told."""
        return self.why or "shutdown"

    @cancel_reason.setter
    def cancel_reason(self, reason: str) -> None:
        self.why = reason

    @property
    def entry(self) -> Entry:
        """The entry held, as retiring it needs it (its id and in-flight index field): built
        when asked, not kept (a token or fields dict kept per trigger cost ~0.35 KB)."""
        return Entry(self.stream, self.entry_id, {b"trigger_id": str(self.trigger_id).encode()})

    @entry.setter
    def entry(self, entry: Entry) -> None:
        # Interned: the stream's name is shared by every trigger held from it.
        self.stream, self.entry_id = sys.intern(entry.stream), entry.id

    @property
    def key(self) -> tuple[str, str]:
        """The held entry's stream and id: what names it (broker rule 35)."""
        return (self.stream, self.entry_id)

    def __lt__(self, other: Held) -> bool:
        # The timers' heap holds the Helds themselves (no tuple per timer): by moment, then
        # trigger id.
        assert self.moment is not None and other.moment is not None
        if self.moment != other.moment:
            return self.moment < other.moment
        return self.trigger_id < other.trigger_id

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
