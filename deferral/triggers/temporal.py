"""Triggers that wait for a moment in time."""

from __future__ import annotations

import datetime as dt
from collections.abc import AsyncIterator
from typing import Any

import anyio

from deferral.runtime import clock
from deferral.timezone import standard_datetime
from deferral.triggers.base import BaseTrigger, TriggerEvent, classpath_of
from deferral.triggers.task_end import TaskSuccessEvent

# Sleep in bounded steps and re-read the wall clock, so a suspended host or a clock step does
# not stretch the wait by the full remaining time.
_MAX_SLEEP_SEC = 60.0


class DateTimeTrigger(BaseTrigger):
    """Fires once ``moment`` (tz-aware) has passed; the event payload is ``moment``. Shared:
    tasks waiting on the same moment wait on one trigger."""

    shared = True

    def __init__(self, moment: dt.datetime, *, end_from_trigger: bool = False) -> None:
        super().__init__()
        # As Airflow 2.10's: the task succeeds at the moment, in the triggerer (TaskSuccessEvent).
        self.end_from_trigger = bool(end_from_trigger)
        if not isinstance(moment, dt.datetime):
            raise TypeError(f"moment must be a datetime, got {type(moment).__name__}")
        if moment.tzinfo is None or moment.utcoffset() is None:
            raise ValueError("moment must be a tz-aware datetime")
        self.moment = standard_datetime(moment)

    def serialize(self) -> tuple[str, dict[str, Any]]:
        kwargs: dict[str, Any] = {"moment": self.moment}
        if self.end_from_trigger:  # (left out otherwise: what was serialized before stays equal)
            kwargs["end_from_trigger"] = True
        return classpath_of(DateTimeTrigger), kwargs

    def fires_at(self) -> dt.datetime | None:
        # Only while this class's own run(), cleanup() and on_kill() are what would run: a
        # subclass that overrides one of them gets it run.
        cls = type(self)
        own = (
            cls.run is DateTimeTrigger.run
            and cls.cleanup is BaseTrigger.cleanup
            and cls.on_kill is BaseTrigger.on_kill
        )
        return self.moment if own and not self.end_from_trigger else None

    async def run(self) -> AsyncIterator[TriggerEvent]:
        while (left := (self.moment - clock.now()).total_seconds()) > 0:
            await anyio.sleep(min(left, _MAX_SLEEP_SEC))
        yield TaskSuccessEvent() if self.end_from_trigger else TriggerEvent(self.moment)


class TimeDeltaTrigger(DateTimeTrigger):
    """Fires ``delta`` after it was created. It serializes the absolute moment (under its own
    classpath, so it shows as the class the task deferred on), so a triggerer restart or a move
    to another triggerer never restarts the wait: rebuilt from its kwargs it takes ``moment``
    instead of ``delta``. It is shared as that moment is: two tasks share it only when their
    moments are equal to the microsecond (a delta is counted from when each task deferred;
    nothing is rounded)."""

    def __init__(
        self,
        delta: dt.timedelta | None = None,
        *,
        moment: dt.datetime | None = None,
        end_from_trigger: bool = False,
    ) -> None:
        if moment is None:
            if not isinstance(delta, dt.timedelta):
                raise TypeError(f"delta must be a timedelta, got {type(delta).__name__}")
            moment = clock.now() + delta
        elif delta is not None:
            raise TypeError("give either delta or moment (the serialized form), not both")
        super().__init__(moment, end_from_trigger=end_from_trigger)

    def serialize(self) -> tuple[str, dict[str, Any]]:
        _, kwargs = super().serialize()
        return classpath_of(TimeDeltaTrigger), kwargs


# The classes whose trigger only waits for the moment in its kwargs (``moment``): a deferral on
# one whose moment is far ahead waits as a row until it comes near (deferral.store.far_timers).
TIME_TRIGGER_CLASSPATHS = frozenset({classpath_of(DateTimeTrigger), classpath_of(TimeDeltaTrigger)})
