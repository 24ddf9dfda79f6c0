"""Deadline alerts (Airflow 3.1's ``airflow.sdk.definitions.deadline``): ``DAG(deadline=
DeadlineAlert(reference=..., interval=..., callback=...))``. When a run has not finished by
``reference + interval``, the miss is recorded once (``deadline_miss``, one row per run and alert:
of two scheduler replicas, the one whose insert wins runs the callback) and counted
(``deferral_deadline_misses_total``).

The references: ``DeadlineReference.DAGRUN_QUEUED_AT`` (the run's creation),
``DAGRUN_LOGICAL_DATE``, and ``FIXED_DATETIME(datetime)``. The callback is
``AsyncCallback(callable_or_path, kwargs)`` or ``SyncCallback(...)`` (or a plain callable),
called with its kwargs and, if it takes one, ``context`` (dag_id, run_id, logical_date,
deadline). Both run in the scheduler replica that recorded the miss, off its loop (an async one
in an event loop of its own): see docs/approvals-and-deadlines.md for why not in a worker or the
triggerer.

Task ``sla=`` (Airflow 2) maps to a DeadlineAlert on DAGRUN_QUEUED_AT with the smallest ``sla`` of
the DAG's tasks, its callback the DAG's ``sla_miss_callback``, with a DeprecationWarning.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import importlib
import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from deferral.timezone import make_aware

# At most this many alerts on one DAG (bounded work per run).
MAX_ALERTS = 10


@dataclass(frozen=True)
class _Reference:
    """Where a deadline counts from: a run's column, or a fixed moment."""

    kind: str
    moment: dt.datetime | None = None

    def start(self, queued_at: dt.datetime, logical_date: dt.datetime) -> dt.datetime:
        if self.kind == "DAGRUN_QUEUED_AT":
            return queued_at
        if self.kind == "DAGRUN_LOGICAL_DATE":
            return logical_date
        assert self.moment is not None
        return self.moment


class DeadlineReference:
    """The reference points of a DeadlineAlert, by Airflow's names."""

    DAGRUN_QUEUED_AT = _Reference("DAGRUN_QUEUED_AT")
    DAGRUN_LOGICAL_DATE = _Reference("DAGRUN_LOGICAL_DATE")

    @staticmethod
    def FIXED_DATETIME(moment: dt.datetime) -> _Reference:
        if not isinstance(moment, dt.datetime):
            raise TypeError(f"FIXED_DATETIME needs a datetime, not {type(moment).__name__}")
        return _Reference("FIXED_DATETIME", make_aware(moment))


@dataclass(frozen=True)
class Callback:
    """A callable (or its dotted path, imported when the miss is recorded) and its kwargs."""

    callback_callable: Callable[..., Any] | str
    kwargs: Mapping[str, Any] = field(default_factory=dict)

    def resolve(self) -> Callable[..., Any]:
        target = self.callback_callable
        if isinstance(target, str):
            module, _, name = target.rpartition(".")
            target = getattr(importlib.import_module(module), name)
        if not callable(target):
            raise TypeError(f"deadline callback {target!r} is not callable")
        return target


class AsyncCallback(Callback):
    """A coroutine function to await when the deadline is missed."""


class SyncCallback(Callback):
    """A plain function to call when the deadline is missed."""


@dataclass(frozen=True)
class DeadlineAlert:
    reference: _Reference
    interval: dt.timedelta
    callback: Callback | Callable[..., Any] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.reference, _Reference):
            raise TypeError("DeadlineAlert reference must be one of DeadlineReference's")
        if not isinstance(self.interval, dt.timedelta):
            raise TypeError("DeadlineAlert interval must be a timedelta")
        if self.callback is not None and not (
            isinstance(self.callback, Callback) or callable(self.callback)
        ):
            raise TypeError(
                "DeadlineAlert callback must be an AsyncCallback, SyncCallback or callable"
            )

    def deadline(self, queued_at: dt.datetime, logical_date: dt.datetime) -> dt.datetime:
        return self.reference.start(queued_at, logical_date) + self.interval


def deadline_alerts(value: object, where: str) -> list[DeadlineAlert]:
    """``DAG(deadline=...)``: one alert or a list of them; ValueError naming ``where``."""
    if value is None:
        return []
    alerts = list(value) if isinstance(value, list | tuple) else [value]
    if len(alerts) > MAX_ALERTS:
        raise ValueError(f"{where}: {len(alerts)} deadline alerts, at most {MAX_ALERTS}")
    checked: list[DeadlineAlert] = []
    for alert in alerts:
        if not isinstance(alert, DeadlineAlert):
            raise ValueError(f"{where}: deadline must be a DeadlineAlert (or a list of them)")
        checked.append(alert)
    return checked


def sla_alert(slas: Sequence[dt.timedelta], callback: Callable[..., Any] | None) -> DeadlineAlert:
    """What Airflow 2's task ``sla`` (the DAG's smallest) and ``sla_miss_callback`` map to."""
    return DeadlineAlert(DeadlineReference.DAGRUN_QUEUED_AT, min(slas), callback)


def run_callback(alert: DeadlineAlert, context: Mapping[str, Any]) -> None:
    """Call the alert's callback with its kwargs (and ``context`` if it takes it); an async one
    in an event loop of its own. Raises what the callback raises."""
    if alert.callback is None:
        return
    if isinstance(alert.callback, Callback):
        target, kwargs = alert.callback.resolve(), dict(alert.callback.kwargs)
    else:
        target, kwargs = alert.callback, {}
    try:
        takes_context = "context" in inspect.signature(target).parameters
    except (TypeError, ValueError):
        takes_context = False
    if takes_context:
        kwargs["context"] = dict(context)
    result = target(**kwargs)
    if inspect.isawaitable(result):
        asyncio.run(_awaited(result))


async def _awaited(awaitable: Any) -> None:
    await awaitable
