"""Triggers: small async waits that run in the triggerer and fire events that resume tasks."""

from __future__ import annotations

import abc
import datetime as dt
from collections.abc import AsyncIterator, Mapping
from typing import Any, ClassVar


class TriggerEvent:
    """What a trigger yields; ``payload`` reaches the resumed task as ``event``."""

    __slots__ = ("payload",)

    def __init__(self, payload: Any) -> None:
        self.payload = payload

    def __repr__(self) -> str:
        return f"TriggerEvent({self.payload!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, TriggerEvent) and other.payload == self.payload

    def __hash__(self) -> int:
        return hash(repr(self.payload))


class TriggerProgress:
    """What a trigger may yield before its event: ``payload`` is recorded (the last few per
    try, shown on the task page and by ``deferral tasks explain``) and resumes nothing; only a
    :class:`TriggerEvent` resumes the task."""

    __slots__ = ("payload",)

    def __init__(self, payload: Any) -> None:
        self.payload = payload

    def __repr__(self) -> str:
        return f"TriggerProgress({self.payload!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, TriggerProgress) and other.payload == self.payload

    def __hash__(self) -> int:
        return hash(repr(self.payload))


class BaseTrigger(abc.ABC):
    """Subclass and implement ``serialize`` and ``run``.

    A trigger is rebuilt in the triggerer from ``serialize()``'s classpath and kwargs, possibly
    more than once (events are delivered at least once), so ``serialize`` must be deterministic
    and ``run`` free of side effects that break when it runs twice.
    """

    # True: tasks deferring on equal instances (same classpath and kwargs) share one running
    # trigger, whose event resumes each of them. Only for a trigger whose event means the same
    # to every waiter and whose run() does nothing on any one task's behalf.
    shared: ClassVar[bool] = False

    def __init__(self, **kwargs: Any) -> None:
        self.trigger_id: int | None = None

    @abc.abstractmethod
    def serialize(self) -> tuple[str, dict[str, Any]]:
        """Return ``(classpath, kwargs)``; ``classpath(**kwargs)`` must rebuild this trigger."""

    @abc.abstractmethod
    def run(self) -> AsyncIterator[TriggerEvent | TriggerProgress]:
        """An async generator that yields TriggerEvent; the first one resumes the task. Any
        TriggerProgress it yields before is recorded and resumes nothing."""

    def fires_at(self) -> dt.datetime | None:
        """The moment this trigger fires, if waiting for it is all it does and its event is
        ``TriggerEvent(moment)``; the triggerer then waits for it on one shared timer instead of
        running ``run()`` in a task of its own (a small fraction of the memory). None, the
        default: ``run()`` runs."""
        return None

    @classmethod
    def nested_classpaths(cls, kwargs: Mapping[str, Any]) -> tuple[str, ...]:
        """The classes this trigger builds and runs from its ``kwargs`` (an ``AnyOf``'s branch
        that runs): the triggerer allows them as it allows the trigger's own class."""
        return ()

    async def cleanup(self) -> None:  # noqa: B027 - optional hook, empty by default
        """Called after ``run`` ends, however it ends."""

    async def on_kill(self) -> None:  # noqa: B027 - optional hook, empty by default
        """Called only when a user cancels the task, never on hand-off or shutdown."""

    def __repr__(self) -> str:
        classpath, kwargs = self.serialize()
        return f"<{classpath} {sorted(kwargs)}>"


def classpath_of(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"
