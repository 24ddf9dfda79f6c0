"""What waits: every deferred task (the web UI's Deferred page), how long each has waited and
how close its timeout is, and what resumes a wait kept as a row (no triggerer runs it)."""

from __future__ import annotations

import datetime as dt
from collections.abc import Collection
from typing import Any, Literal

from sqlalchemy import ColumnElement, ColumnExpressionArgument, Select, func, select, tuple_
from sqlalchemy.orm import Session

from deferral.runtime.config import Settings
from deferral.states import TaskState
from deferral.store import liveness
from deferral.store.actions import ti_label
from deferral.store.tables import (
    SignalWait,
    TaskInstance,
    TaskStateChange,
    Trigger,
    Triggerer,
    WaitTimer,
)
from deferral.triggers.approval import APPROVAL_TRIGGER
from deferral.triggers.asset_event import ASSET_KEY_PREFIX, ASSET_TRIGGER
from deferral.triggers.composite import ALL_OF, ANY_OF, COMPOSITES
from deferral.triggers.signal import CALLBACK_TRIGGER, SIGNAL_TRIGGER
from readmodel.pages import decode, encode
from readmodel.records import db_now, seconds_between

Record = dict[str, Any]

# The Deferred page lists this many task instances a page by default, and at most MAX_DEFERRED_PAGE;
# it counts them up to DEFERRED_COUNTED_AT_MOST (a million waiting are not counted at each look).
DEFERRED_PAGE = 500
MAX_DEFERRED_PAGE = 2000
DEFERRED_COUNTED_AT_MOST = 10_000
# A deferral is "close to expiry" in the last fifth of its wait, and always in its last 5 min.
EXPIRY_SOON_FRACTION = 0.2
EXPIRY_SOON_CAP_SEC = 300.0

RowWait = Literal["signal", "callback", "asset event", "approval", "composite"]

_ROW_WAITS: dict[str, RowWait] = {
    SIGNAL_TRIGGER: "signal",
    CALLBACK_TRIGGER: "callback",
    ASSET_TRIGGER: "asset event",
    APPROVAL_TRIGGER: "approval",
    ANY_OF: "composite",
    ALL_OF: "composite",
}
# What a composite with a branch that runs in a triggerer is shown as.
RUNNING_COMPOSITE = "a composite wait: one branch runs in a triggerer, the others are rows"


def held_by_rows(trigger_id: ColumnExpressionArgument[int | None]) -> ColumnElement[bool]:
    """True when rows hold the whole wait of ``trigger_id`` (a composite without a branch that
    runs: its rows and timer say so); false for a composite whose running branch is in a
    triggerer."""
    return (
        select(SignalWait.trigger_id)
        .where(SignalWait.trigger_id == trigger_id, SignalWait.holds)
        .exists()
        | select(WaitTimer.trigger_id)
        .where(WaitTimer.trigger_id == trigger_id, WaitTimer.holds)
        .exists()
    )


def held_of(session: Session, trigger_ids: Collection[int]) -> set[int]:
    """Of these triggers, those :func:`held_by_rows` (each through its rows' index on the
    trigger id)."""
    if not trigger_ids:
        return set()
    query = select(Trigger.id).where(Trigger.id.in_(trigger_ids), held_by_rows(Trigger.id))
    return set(session.scalars(query))


def is_held(session: Session, trigger_id: int) -> bool:
    """:func:`held_by_rows` of one trigger."""
    return bool(held_of(session, [trigger_id]))


def row_wait_of(classpath: str | None, held: bool = True) -> RowWait | None:
    """ "signal", "callback", "asset event", "approval" or "composite" for a trigger class
    whose waits a send, an asset event's record, an answer (or the scheduler's timer pass)
    resumes (no triggerer ever picks them up, so "not picked up yet" would be a false alarm);
    None for others, and for a composite not ``held`` by its rows (a branch of it runs in a
    triggerer)."""
    if classpath in COMPOSITES and not held:
        return None
    return _ROW_WAITS.get(classpath or "")


def signal_key(session: Session, trigger_id: int | None) -> str | None:
    """The key a signal or asset event wait listens on (a callback's key is its token's: never
    shown)."""
    if trigger_id is None:
        return None
    return session.scalar(select(SignalWait.key).where(SignalWait.trigger_id == trigger_id))


def needs_key(wait: RowWait | None) -> bool:
    """Whether :func:`how_to_resume` names the wait's key."""
    return wait in ("signal", "asset event")


def how_to_resume(wait: RowWait, key: str | None) -> str:
    """One line telling a reader what resumes the task."""
    if wait == "callback":
        return "a POST of its answer to its callback URL (POST /api/v1/callbacks/<token>)"
    if wait == "approval":
        return (
            "an answer to its approval request (`deferral approvals respond`, the web UI's"
            " Required actions)"
        )
    if wait == "composite":
        return (
            "its branches: signals or callbacks on its keys, asset events, approvals, and its"
            " timer (docs/waits.md)"
        )
    if wait == "asset event" and key is not None and key.startswith(ASSET_KEY_PREFIX):
        asset = key.removeprefix(ASSET_KEY_PREFIX)
        return f"an event of asset {asset!r} (a task with it as outlet succeeding, or a watcher)"
    return f"a signal sent to key {key!r} (`deferral signals send {key} --payload JSON`)"


def wait_record(since: dt.datetime | None, timeout: dt.datetime | None, now: dt.datetime) -> Record:
    """How long a deferral has waited, how long it has left, and whether that is close."""
    left = None if timeout is None else round((timeout - now).total_seconds(), 1)
    return {
        "since": since,
        "waited_sec": None if since is None else seconds_between(since, now),
        "timeout": timeout,
        "seconds_left": left,
        "urgency": expiry_urgency(since, timeout, now),
    }


def expiry_urgency(
    since: dt.datetime | None, timeout: dt.datetime | None, now: dt.datetime
) -> str | None:
    """ "expired" past the timeout, "soon" in the last fifth of the wait (at most its last
    EXPIRY_SOON_CAP_SEC), else None (also without a timeout)."""
    if timeout is None:
        return None
    left = (timeout - now).total_seconds()
    if left < 0:
        return "expired"
    whole = (timeout - since).total_seconds() if since is not None else EXPIRY_SOON_CAP_SEC
    return "soon" if left <= min(EXPIRY_SOON_CAP_SEC, EXPIRY_SOON_FRACTION * whole) else None


# -- what waits now ------------------------------------------------------------------------------


def deferred_now(
    session: Session, settings: Settings, *, limit: int = DEFERRED_PAGE, after: str | None = None
) -> Record:
    """A page of deferred tasks (from just after cursor ``after``) in the order they deferred,
    grouped by trigger class and triggerer, the group waiting longest first; timeouts close to
    expiry flagged. How many are deferred is counted up to DEFERRED_COUNTED_AT_MOST."""
    now = db_now(session)
    ti = TaskInstance
    rows = session.execute(deferred_page_query(limit, after)).all()
    counted = session.scalar(
        select(func.count()).select_from(
            select(ti.id)
            .where(ti.state == TaskState.DEFERRED)
            .limit(DEFERRED_COUNTED_AT_MOST + 1)
            .subquery()
        )
    )
    shown = rows[:limit]
    alive = {
        name
        for name, state, beat in session.execute(
            select(Triggerer.name, Triggerer.state, Triggerer.latest_heartbeat)
        )
        if liveness.is_alive(state, beat, now, settings.heartbeat_sec)
    }
    held = held_of(session, {row.trigger_id for row in shown if row.classpath in COMPOSITES})
    groups: dict[tuple[str | None, str | None, bool], Record] = {}
    for row in shown:
        running = row.classpath in COMPOSITES and row.trigger_id not in held
        key = (row.classpath, row.triggerer_id, running)
        group = groups.setdefault(
            key,
            {
                "classpath": row.classpath,
                "row_wait": row_wait_of(row.classpath, not running),
                "running_branch": running,
                "triggerer": row.triggerer_id,
                "triggerer_alive": row.triggerer_id in alive,
                "tasks": [],
            },
        )
        group["tasks"].append(
            {
                "dag_id": row.dag_id,
                "run_id": row.run_id,
                "task_id": row.task_id,
                "map_index": row.map_index,
                "label": ti_label(row.task_id, row.map_index),
                "trigger_id": row.trigger_id,
                **wait_record(row.since, row.trigger_timeout, now),
            }
        )
    for group in groups.values():
        tasks = group["tasks"]
        group["count"] = len(tasks)
        group["oldest_since"] = tasks[0]["since"]
        group["soon"] = sum(1 for t in tasks if t["urgency"] is not None)
    return {
        "total": min(counted or 0, DEFERRED_COUNTED_AT_MOST),
        "total_capped": (counted or 0) > DEFERRED_COUNTED_AT_MOST,
        "listed": len(shown),
        "groups": list(groups.values()),  # rows came oldest first, so do the groups
        "after": after,
        "next_after": (
            encode((shown[-1].trigger_id, shown[-1].id)) if len(rows) > limit and shown else None
        ),
    }


def deferred_page_query(limit: int, after: str | None) -> Select[*tuple[Any, ...]]:
    """The deferred task instances of one page (and one more, if any) in the order they
    deferred: by trigger, created when a task defers (a task that joined a shared trigger stands
    with its first waiter), read in the order of ix_task_instance_deferred_order."""
    ti = TaskInstance
    since = (
        select(func.max(TaskStateChange.at))
        .where(TaskStateChange.task_instance_id == ti.id, TaskStateChange.to_state == "deferred")
        .scalar_subquery()
        .label("since")
    )
    query = (
        select(
            ti.id,
            ti.dag_id,
            ti.run_id,
            ti.task_id,
            ti.map_index,
            ti.trigger_id,
            ti.trigger_timeout,
            Trigger.classpath,
            Trigger.triggerer_id,
            since,
        )
        .outerjoin(Trigger, Trigger.id == ti.trigger_id)
        .where(ti.state == TaskState.DEFERRED)
        .order_by(ti.trigger_id, ti.id)
        .limit(limit + 1)
    )
    if after is not None:
        last_trigger, last_id = decode(after, int, int)
        query = query.where(tuple_(ti.trigger_id, ti.id) > (last_trigger, last_id))
    return query
