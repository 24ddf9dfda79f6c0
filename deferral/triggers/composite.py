"""Waits that compose: ``AnyOf(name=wait, ...)`` resumes the task when its first branch fires,
``AllOf(name=wait, ...)`` once every branch has fired.

Branches that need no running code (time, signals, callbacks, asset events, approvals) are held as
rows beside the task's trigger row plus one timer (``deferral.store.waits``), never as a coroutine:
a send, a callback, an asset event's record, an answer or the scheduler's timer pass resolves them.
An ``AnyOf`` may also hold one branch that must run (an HTTP poll): that branch runs in a triggerer
as a normal trigger, the others stay rows."""

from __future__ import annotations

import datetime as dt
import importlib
from collections.abc import AsyncIterator, Iterable, Mapping
from typing import Any, ClassVar

from deferral.triggers.approval import APPROVAL_TRIGGER
from deferral.triggers.asset_event import ASSET_TRIGGER
from deferral.triggers.base import BaseTrigger, TriggerEvent, classpath_of
from deferral.triggers.signal import CALLBACK_TRIGGER, SIGNAL_TRIGGER, SignalError
from deferral.triggers.temporal import TIME_TRIGGER_CLASSPATHS

# The branches' kinds, as ``deferral.store.waits`` holds them.
SIGNAL, CALLBACK, ASSET, APPROVAL = "signal", "callback", "asset", "approval"
TIME, RUNNING = "time", "running"
# The kwarg the serialized branches travel in (no branch may take that name).
BRANCHES = "branches"


def branch_kind(classpath: str, kwargs: Mapping[str, Any]) -> str:
    """How a branch (its trigger's classpath and kwargs, as serialized) waits."""
    if classpath == SIGNAL_TRIGGER:
        return SIGNAL
    if classpath == CALLBACK_TRIGGER:
        return CALLBACK
    if classpath == ASSET_TRIGGER:
        return ASSET
    if classpath == APPROVAL_TRIGGER:
        return APPROVAL
    if classpath in TIME_TRIGGER_CLASSPATHS and not kwargs.get("end_from_trigger"):
        return TIME
    return RUNNING


def _serialized(name: object, trigger: object) -> tuple[str, str, dict[str, Any]]:
    if not isinstance(name, str) or not name.isidentifier() or name.startswith("_"):
        raise SignalError(
            f"branch name {name!r:.40} is invalid: use an identifier without a leading _"
        )
    if isinstance(trigger, _Composite):
        raise SignalError(f"branch {name!r} is a {type(trigger).__name__}: composites do not nest")
    if not isinstance(trigger, BaseTrigger):
        raise SignalError(f"branch {name!r} is {trigger!r:.40}, not a trigger")
    classpath, kwargs = trigger.serialize()
    return name, classpath, dict(kwargs)


class _Composite(BaseTrigger):
    all_of: ClassVar[bool] = False

    def __init__(self, branches: Iterable[Any] | None = None, **named: BaseTrigger) -> None:
        super().__init__()
        if isinstance(branches, BaseTrigger):
            raise SignalError(f"branch name {BRANCHES!r} is reserved: use another")
        if branches is not None and named:
            raise SignalError(f"{type(self).__name__}: give named branches, not {BRANCHES!r}")
        if branches is None:
            items = [_serialized(name, trigger) for name, trigger in named.items()]
        else:  # rebuilt from serialize()
            items = [(str(n), str(c), dict(k)) for n, c, k in branches]
        if not items:
            raise SignalError(f"{type(self).__name__} needs at least one named branch")
        self.branches: list[tuple[str, str, dict[str, Any]]] = items
        running = [name for name, c, k in items if branch_kind(c, k) == RUNNING]
        if running and self.all_of:
            raise SignalError(
                f"AllOf branch {running[0]!r} must run in a triggerer: only an AnyOf may hold one"
            )
        if len(running) > 1:
            raise SignalError(
                f"AnyOf branches {running[0]!r} and {running[1]!r} both must run in a"
                " triggerer: at most one may"
            )
        self.running = running[0] if running else None

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return classpath_of(type(self)), {BRANCHES: [list(b) for b in self.branches]}

    @classmethod
    def nested_classpaths(cls, kwargs: Mapping[str, Any]) -> tuple[str, ...]:
        return tuple(c for _, c, k in kwargs.get(BRANCHES, ()) if branch_kind(c, k) == RUNNING)

    def _inner(self) -> BaseTrigger:
        """The branch that runs (the triggerer checked its classpath against its allowed
        modules before building this trigger)."""
        name, classpath, kwargs = next(b for b in self.branches if b[0] == self.running)
        module, _, class_name = classpath.rpartition(".")
        inner = getattr(importlib.import_module(module), class_name)(**kwargs)
        inner.trigger_id = self.trigger_id
        if not isinstance(inner, BaseTrigger):
            raise SignalError(f"branch {name!r} is not a trigger")
        return inner

    async def run(self) -> AsyncIterator[TriggerEvent]:
        if self.running is None:
            raise SignalError(
                f"{type(self).__name__} waits are resumed by signals, callbacks and the"
                " scheduler's timers, not run in a triggerer"
            )
        self._running_trigger = inner = self._inner()
        try:
            async for event in inner.run():
                yield TriggerEvent({"fired": self.running, "payload": event.payload})
                return
        finally:
            await inner.cleanup()

    async def on_kill(self) -> None:
        inner = getattr(self, "_running_trigger", None)
        if inner is not None:
            await inner.on_kill()


class AnyOf(_Composite):
    """Resumes the task when the first of its named branches fires, with ``event``
    ``{"fired": name, "payload": that branch's payload}``; the other branches are retired in
    the same transaction. A time branch (``TimeDeltaTrigger``) is how a wait times out into a
    default instead of failing."""


class AllOf(_Composite):
    """Resumes the task once every named branch has fired, with ``event``
    ``{"fired": [names, in the order given], "payloads": {name: payload}}``. A branch that
    fired keeps its first payload; a time branch has fired once its moment passed."""

    all_of = True


ANY_OF = classpath_of(AnyOf)
ALL_OF = classpath_of(AllOf)
COMPOSITES = frozenset({ANY_OF, ALL_OF})


def moment_of(kwargs: Mapping[str, Any]) -> dt.datetime:
    """A time branch's moment (its kwargs as serialized, values restored)."""
    moment = kwargs["moment"]
    if not isinstance(moment, dt.datetime):
        raise SignalError("a time branch's moment is not a datetime")
    return moment
