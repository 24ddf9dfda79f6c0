"""Far timers wait as rows: a time trigger (``DateTimeTrigger``, ``TimeDeltaTrigger``) whose
moment is beyond the horizon (``DEFERRAL_FAR_TIMER_HORIZON_SEC``) when its task defers is
committed like any trigger, with its moment in ``trigger.far_moment``, and its entry is not
published then. Until the moment comes within the horizon no triggerer holds it, no pending entry
is renewed for it, and a takeover, a restart or a Redis wipe costs nothing for it. A bounded,
indexed pass (:func:`take_due`, run by the scheduler) then publishes it to its triggers stream and
clears ``far_moment`` in the transaction that held the row locked, so a crash between the two
publishes it again (a duplicate entry, harmless) and never loses it.

``far_moment`` set means "not yet published"; the reconciler and ``doctor`` leave such triggers
alone (:func:`published`)."""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import ColumnElement, ColumnExpressionArgument, select, text
from sqlalchemy.orm import Session

from deferral.runtime import serialization
from deferral.store.tables import Trigger
from deferral.triggers.temporal import TIME_TRIGGER_CLASSPATHS

DEFAULT_HORIZON = dt.timedelta(minutes=10)


def far_moment(
    classpath: str, trigger_kwargs: Mapping[str, Any], now: dt.datetime, horizon: dt.timedelta
) -> dt.datetime | None:
    """The moment of a deferral's trigger if it is a time trigger due beyond ``now + horizon``
    (its entry waits as a row until then), else None (published at deferral, as any trigger).
    ``trigger_kwargs`` as the worker carries them (serialization's JSON form). Any other
    trigger, or kwargs without a readable moment, is published now: holding is the safe side."""
    if classpath not in TIME_TRIGGER_CLASSPATHS:
        return None
    try:
        moment = serialization.from_jsonable(trigger_kwargs.get("moment"))
    except serialization.SerializationError:
        return None
    if not isinstance(moment, dt.datetime) or moment.utcoffset() is None:
        return None
    return moment if moment > now + horizon else None


def published(trigger_id: ColumnExpressionArgument[int | None]) -> ColumnElement[bool]:
    """True for a deferred task's ``trigger_id`` whose entry has been published (no far timer
    still waiting as a row): a trigger that must be in a stream (the reconciler's and the
    doctor's check)."""
    return ~(
        select(Trigger.id).where(Trigger.id == trigger_id, Trigger.far_moment.is_not(None)).exists()
    )


@dataclass(frozen=True)
class TriggerWaiter:
    """A trigger row and a task waiting on it: what its triggers-stream entry is built from
    (``broker.streams.waiter_entry``)."""

    trigger_id: int
    classpath: str
    kwargs_token: str  # the trigger's kwargs, sealed as stored
    task_instance_id: int
    try_number: int
    queue: str
    dag_id: str
    run_id: str
    task_id: str
    map_index: int


@dataclass(frozen=True)
class DueTimers:
    """What :func:`take_due` locked: every trigger taken, and the first task waiting on each
    that still has one (a shared trigger may have several; a cleared or timed-out task none)."""

    trigger_ids: list[int]
    waiters: list[TriggerWaiter]


# The unpublished time triggers due within the horizon, earliest first, locked (those another
# replica or a joining deferral holds are skipped: taken by a later pass), read through the
# partial index on far_moment; each with the first task that waits on it.
_DUE_SQL = text(
    """
    WITH due AS (
        SELECT id, classpath, kwargs FROM trigger
        WHERE far_moment IS NOT NULL
            AND far_moment <= now() + CAST(:horizon AS interval)
        ORDER BY far_moment
        LIMIT :limit
        FOR UPDATE SKIP LOCKED
    )
    SELECT DISTINCT ON (due.id) due.id AS trigger_id, due.classpath, due.kwargs AS kwargs_token,
        ti.id AS task_instance_id, ti.try_number, ti.queue, ti.dag_id, ti.run_id, ti.task_id,
        ti.map_index
    FROM due LEFT JOIN task_instance AS ti
        ON ti.trigger_id = due.id AND ti.state = 'deferred'
    ORDER BY due.id, ti.id
    """
)

_MARK_PUBLISHED_SQL = text(
    "UPDATE trigger SET far_moment = NULL WHERE id = ANY(CAST(:ids AS bigint[]))"
)


def take_due(session: Session, horizon: dt.timedelta, limit: int) -> DueTimers:
    """Lock up to ``limit`` far timers whose moment is within ``horizon`` of now (the database's
    clock), earliest first. The caller publishes their entries, then :func:`mark_published`,
    then commits: the locks keep other replicas off them until then."""
    rows = list(session.execute(_DUE_SQL, {"horizon": horizon, "limit": limit}))
    return DueTimers(
        [row.trigger_id for row in rows],
        [TriggerWaiter(**row._mapping) for row in rows if row.task_instance_id is not None],
    )


def mark_published(session: Session, trigger_ids: Sequence[int]) -> None:
    """Their entries are published: they are triggers like any other from now on."""
    session.execute(_MARK_PUBLISHED_SQL, {"ids": list(trigger_ids)})
