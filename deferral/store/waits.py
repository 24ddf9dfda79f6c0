"""Waits held as rows (issue 33): the branches of an ``AnyOf`` / ``AllOf`` that need no running
code, the payload filters of signal waits, and the ``cancel_on`` of a deferral.

A deferral's rows sit beside its trigger row and go with it (``ON DELETE CASCADE``):

- ``signal_wait``: one row per signal or callback the task waits on: ``branch`` '' for a plain
  ``SignalTrigger``, the branch's name in a composite, :data:`CANCEL_BRANCH` for a cancel-on;
  ``match`` its filter as a jsonpath predicate that PostgreSQL evaluates against the payload;
  ``holds`` false when a trigger of the deferral still runs in a triggerer;
- ``wait_timer``: a composite's one timer, the earliest time branch of an any-of, the latest of
  an all-of, fired by the scheduler's bounded pass over ``ix_wait_timer_due_at``
  (:func:`fire_due_timers`);
- ``callback_heartbeat``: the heartbeat deadline of a callback that beats
  (``CallbackTrigger(heartbeat=)``), pushed on by each heartbeat (:func:`beat`) and failed by the
  scheduler's bounded pass over ``ix_callback_heartbeat_due_at`` (:func:`fail_missed_heartbeats`).

An asset event wait (``AssetEventTrigger``) is a ``signal_wait`` row keyed ``asset/<name>``: the
transaction that records an event of the asset (a success with outlets, an alias event, a
watcher's event) resumes its waiters (:func:`resume_asset_waiters`), after taking the key's lock
as a send does.

Whatever resolves a wait (a send, a callback, a lookback, an asset event, the timer pass) comes
here with the rows it matched (:class:`Hit`). An any-of resumes through
``transitions.resume_many``, whose conditional claim (only a task deferred on the trigger, locked)
makes a signal and the timer racing on one task resume it once; resuming drops the trigger row, and
with it the losing branches' rows, in that transaction. An all-of's branch is first recorded as
fired (its task row locked first, so two branches firing at once are serialized), and the task
resumes when no branch is left. A cancel-on ends the task (``transitions.cancel_waiting``)."""

from __future__ import annotations

import datetime as dt
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import text
from sqlalchemy.orm import Session

from deferral.runtime import serialization
from deferral.runtime.crypto import Cipher, Purpose
from deferral.states import TaskState
from deferral.store import transitions
from deferral.store.callback_tokens import CALLBACK_KEY_PREFIX
from deferral.triggers.approval import APPROVAL_KEY_PREFIX
from deferral.triggers.asset_event import ASSET_KEY_PREFIX, asset_key
from deferral.triggers.composite import (
    ALL_OF,
    BRANCHES,
    TIME,
    branch_kind,
    moment_of,
)

# The branch of a cancel-on row: no branch name can be spelt so.
CANCEL_BRANCH = "~cancel"
# Composite timers one pass fires at most (the next pass goes on).
TIMER_PAGE = 1000


# The keys' locks in the order of their lock ids (two keys may share one: no cycle either way);
# a volatile function in the select list is evaluated after the sort. A query of its own, or a
# CTE of a statement that reads something more in the same round trip.
LOCK_KEYS_QUERY = (
    "SELECT pg_advisory_xact_lock(h) FROM ("
    " SELECT DISTINCT hashtextextended('deferral.signal:' || k, 0) AS h"
    " FROM unnest(CAST(:keys AS text[])) AS k) AS ids ORDER BY h"
)
LOCK_SQL = text(LOCK_KEYS_QUERY)


def lock_keys(session: Session, keys: Iterable[str]) -> None:
    """Hold the keys' wait locks until the transaction ends (in lock id order: no deadlock).
    A write that resolves waits (a send, an asset event) and the creation of a wait on the
    same key take it, so a wait either sees the write or is seen by it."""
    distinct = list(set(keys))
    if distinct:
        session.execute(LOCK_SQL, {"keys": distinct})


@dataclass(frozen=True)
class WaitRow:
    """One ``signal_wait`` row of a deferral."""

    key: str
    lookback: dt.timedelta
    branch: str = ""
    match: str | None = None  # the filter's jsonpath predicate
    cancels: str | None = None  # of a cancel-on: the state its task ends in
    heartbeat: dt.timedelta | None = None  # of a callback: how often it must beat
    # Of an approval: its try and its request (a hitl.InputRequest), recorded with the wait.
    asks: tuple[int, Any] | None = None


@dataclass(frozen=True)
class Wait:
    """What a deferral holds as rows: its ``signal_wait`` rows and its timer (branch, moment);
    ``holds`` when they are the whole wait (nothing to publish to a triggerer)."""

    rows: tuple[WaitRow, ...]
    timer: tuple[str, dt.datetime] | None = None
    holds: bool = True
    all_of: bool = False

    @property
    def key(self) -> str:
        """The key ``dags test`` names: the first signal key waited on, else the first
        callback's (a plain callback wait: said as one), else '' (timers, asset events and
        approvals alone: nothing to send)."""
        keys = [
            row.key
            for row in self.rows
            if row.cancels is None
            and not row.key.startswith((ASSET_KEY_PREFIX, APPROVAL_KEY_PREFIX))
        ]
        signal_keys = [key for key in keys if not key.startswith(CALLBACK_KEY_PREFIX)]
        return (signal_keys or keys or [""])[0]


def timer_of(
    classpath: str, branches: Sequence[tuple[str, str, dict[str, Any]]]
) -> tuple[str, dt.datetime] | None:
    """A composite's one timer: of its time branches, the earliest for an any-of, the latest
    for an all-of (it has fired every time branch by then)."""
    times = [
        (moment_of(kwargs), name) for name, c, kwargs in branches if branch_kind(c, kwargs) == TIME
    ]
    if not times:
        return None
    moment, name = max(times) if classpath == ALL_OF else min(times)
    return name, moment


@dataclass(frozen=True)
class Hit:
    """A ``signal_wait`` row a signal matched."""

    trigger_id: int
    branch: str
    cancels: str | None
    all_of: bool


_INSERT_TIMERS_SQL = text(
    "INSERT INTO wait_timer (trigger_id, branch, due_at, holds) SELECT * FROM unnest("
    "CAST(:trigger_ids AS bigint[]), CAST(:branches AS text[]), CAST(:due AS timestamptz[]),"
    " CAST(:holds AS boolean[]))"
)


_INSERT_HEARTBEATS_SQL = text(
    "INSERT INTO callback_heartbeat (trigger_id, key, every_sec, due_at)"
    " SELECT trigger_id, key, every_sec, now() + every_sec * interval '1 second' FROM unnest("
    "CAST(:trigger_ids AS bigint[]), CAST(:keys AS text[]), CAST(:every AS float8[]))"
    " AS h (trigger_id, key, every_sec)"
)


def register_timers(session: Session, waits: Mapping[int, Wait]) -> None:
    """The timers of the composites just deferred (trigger id -> wait), and the heartbeat
    deadlines of their callbacks that beat (the first due one interval from now)."""
    beats = [
        (i, row.key, row.heartbeat.total_seconds())
        for i, w in waits.items()
        for row in w.rows
        if row.heartbeat is not None
    ]
    if beats:
        session.execute(
            _INSERT_HEARTBEATS_SQL,
            {
                "trigger_ids": [b[0] for b in beats],
                "keys": [b[1] for b in beats],
                "every": [b[2] for b in beats],
            },
        )
    timers = {i: (w.timer, w.holds) for i, w in waits.items() if w.timer is not None}
    if timers:
        ids = list(timers)
        session.execute(
            _INSERT_TIMERS_SQL,
            {
                "trigger_ids": ids,
                "branches": [timers[i][0][0] for i in ids],
                "due": [timers[i][0][1] for i in ids],
                "holds": [timers[i][1] for i in ids],
            },
        )


def apply(
    session: Session,
    cipher: Cipher,
    fired: Sequence[tuple[Hit, transitions.FiredEvent]],
    cancelled_by: str,
) -> tuple[int, ...]:
    """Act on the rows a signal (or callback) matched, each with the event it fires for a plain
    wait (``apply_each``, cancel-ons ended with reason ``cancelled_by``). Returns the task
    instances moved."""
    moved = apply_each(session, cipher, [(hit, event, cancelled_by) for hit, event in fired])
    return tuple(ti_id for ids in moved for ti_id in ids)


def apply_each(
    session: Session,
    cipher: Cipher,
    fired: Sequence[tuple[Hit, transitions.FiredEvent, str]],
    *,
    shared_locked: bool = False,
) -> list[tuple[int, ...]]:
    """Act on the rows signals matched, each with the event it fires for a plain wait and the
    reason a cancel-on ends its task with: resume plain waits and any-ofs (in one resume),
    record all-of branches (resuming those complete), end the tasks of cancel-ons. Returns the
    task instances each row moved. ``shared_locked``: the shared triggers among them are locked
    (``transitions.resume_many``)."""
    moved: list[list[int]] = [[] for _ in fired]
    resuming: list[int] = []
    events: list[transitions.FiredEvent] = []
    for n, (hit, event, _) in enumerate(fired):
        if hit.cancels is not None:
            continue
        if hit.branch == "":
            events.append(event)
        elif not hit.all_of or event.failed:  # a failed callback fails an all-of at once
            events.append(_branch_event(cipher, hit.branch, event))
        else:
            continue
        resuming.append(n)
    if events:
        for n, resumed in zip(
            resuming,
            transitions.resume_many(session, events, cipher, shared_locked=shared_locked),
            strict=True,
        ):
            moved[n] += resumed.ids()
    for n, (hit, event, _) in enumerate(fired):
        if hit.all_of and hit.branch and hit.cancels is None and not event.failed:
            moved[n] += _fire_all_of_branch(session, cipher, hit.trigger_id, hit.branch, event)
    for n, (hit, _, reason) in enumerate(fired):
        if hit.cancels is not None:
            moved[n] += transitions.cancel_waiting(
                session, hit.trigger_id, TaskState(hit.cancels), reason
            )
    return [tuple(ids) for ids in moved]


def _resumed(
    session: Session, cipher: Cipher, events: Sequence[transitions.FiredEvent]
) -> list[int]:
    return [ti_id for r in transitions.resume_many(session, events, cipher) for ti_id in r.ids()]


def _value(cipher: Cipher, event: transitions.FiredEvent) -> Any:
    """An event's payload as a value (a signal's travels sealed)."""
    if event.sealed_payload is not None:
        return cipher.open(Purpose.EVENT, event.sealed_payload)
    return event.payload


def _branch_event(
    cipher: Cipher, branch: str, event: transitions.FiredEvent
) -> transitions.FiredEvent:
    """The event an any-of resumes with when ``branch`` fires ``event``."""
    if event.failed:
        return event
    return transitions.FiredEvent(
        event.dedup_key,
        event.trigger_id,
        False,
        {"fired": branch, "payload": _value(cipher, event)},
    )


_LOCK_WAITER_SQL = text(
    "SELECT id FROM task_instance WHERE trigger_id = :trigger_id AND state = 'deferred'"
    " ORDER BY id FOR UPDATE"
)
_MARK_FIRED_SQL = text(
    "UPDATE signal_wait SET fired = :fired"
    " WHERE trigger_id = :trigger_id AND branch = :branch AND fired IS NULL"
)
_LEFT_SQL = text(
    """
    SELECT (SELECT count(*) FROM signal_wait
            WHERE trigger_id = :trigger_id AND cancels IS NULL AND fired IS NULL)
         + (SELECT count(*) FROM wait_timer
            WHERE trigger_id = :trigger_id AND due_at > now()) AS left,
        (SELECT kwargs FROM trigger WHERE id = :trigger_id) AS kwargs
    """
)
_FIRED_SQL = text(
    "SELECT branch, fired FROM signal_wait WHERE trigger_id = :trigger_id AND fired IS NOT NULL"
)


def _fire_all_of_branch(
    session: Session,
    cipher: Cipher,
    trigger_id: int,
    branch: str,
    event: transitions.FiredEvent,
) -> list[int]:
    """Record ``branch`` of the all-of on ``trigger_id`` as fired (its first payload kept), then
    resume the task if no branch is left."""
    if not session.execute(_LOCK_WAITER_SQL, {"trigger_id": trigger_id}).first():
        return []  # resumed, cleared or timed out meanwhile
    sealed = event.sealed_payload or cipher.seal(Purpose.EVENT, event.payload, "event")
    session.execute(_MARK_FIRED_SQL, {"fired": sealed, "trigger_id": trigger_id, "branch": branch})
    return _complete_all_of(session, cipher, trigger_id)


def _branches(cipher: Cipher, kwargs_token: str) -> list[tuple[str, str, dict[str, Any]]]:
    """A composite's branches, from its trigger row's sealed kwargs."""
    plain = serialization.from_jsonable(
        serialization.decode(cipher.decrypt(Purpose.TRIGGER_KWARGS, kwargs_token))
    )
    return [(name, classpath, kwargs) for name, classpath, kwargs in plain[BRANCHES]]


def _moment(cipher: Cipher, kwargs_token: str, branch: str) -> dt.datetime:
    """The moment of a composite's time branch (what a DateTimeTrigger fires with)."""
    return next(moment_of(k) for n, _, k in _branches(cipher, kwargs_token) if n == branch)


def _complete_all_of(session: Session, cipher: Cipher, trigger_id: int) -> list[int]:
    """Resume the all-of on ``trigger_id`` (its task row locked) if every branch has fired."""
    left = session.execute(_LEFT_SQL, {"trigger_id": trigger_id}).one()
    if left.left or left.kwargs is None:
        return []
    fired = {
        row.branch: cipher.open(Purpose.EVENT, row.fired)
        for row in session.execute(_FIRED_SQL, {"trigger_id": trigger_id})
    }
    names, payloads = [], {}
    for name, classpath, kwargs in _branches(cipher, left.kwargs):
        names.append(name)
        payloads[name] = (
            moment_of(kwargs) if branch_kind(classpath, kwargs) == TIME else fired[name]
        )
    event = transitions.FiredEvent(
        f"allof:{trigger_id}", trigger_id, False, {"fired": names, "payloads": payloads}
    )
    return _resumed(session, cipher, [event])


# The composite timers due, a page of them earliest first (ix_wait_timer_due_at), then their
# waiting tasks locked, as every resume locks them first (those a send holds are skipped: the
# next pass finds them again if they still wait). A timer whose trigger no task waits on any
# more (its run deleted, say) is deleted here, so no page is ever full of timers nobody waits
# for.
_DUE_SQL = """
    WITH due AS MATERIALIZED (
        SELECT trigger_id, branch FROM wait_timer
        WHERE due_at <= now()
        ORDER BY due_at
        LIMIT :limit
    ), unwaited AS (
        DELETE FROM wait_timer AS w USING due
        WHERE w.trigger_id = due.trigger_id AND NOT EXISTS (
            SELECT FROM task_instance AS ti
            WHERE ti.trigger_id = due.trigger_id AND ti.state = 'deferred')
    )
    SELECT due.trigger_id, due.branch, t.classpath, t.kwargs
    FROM due
    JOIN task_instance AS ti ON ti.trigger_id = due.trigger_id AND ti.state = 'deferred'
    JOIN trigger AS t ON t.id = due.trigger_id
    WHERE true {among}
    ORDER BY ti.id
    FOR UPDATE OF ti SKIP LOCKED
    """
_DUE_ALL_SQL = text(_DUE_SQL.format(among=""))
_DUE_AMONG_SQL = text(_DUE_SQL.format(among="AND ti.id = ANY(CAST(:among AS bigint[]))"))
_DROP_TIMERS_SQL = text("DELETE FROM wait_timer WHERE trigger_id = ANY(CAST(:ids AS bigint[]))")


def fire_due_timers(
    session: Session,
    cipher: Cipher,
    limit: int = TIMER_PAGE,
    among: Collection[int] | None = None,
) -> list[int]:
    """Fire the composite timers due (at most ``limit``; of the tasks ``among`` these ids, if
    given, as ``expire_deferrals`` takes them): an any-of resumes with its time branch, an
    all-of counts its time branches fired and resumes if nothing else is left. Returns the task
    instances resumed."""
    if among is None:
        due = list(session.execute(_DUE_ALL_SQL, {"limit": limit}))
    else:
        due = list(session.execute(_DUE_AMONG_SQL, {"limit": limit, "among": list(among)}))
    if not due:
        return []
    events = [
        transitions.FiredEvent(
            f"timer:{row.trigger_id}",
            row.trigger_id,
            False,
            {"fired": row.branch, "payload": _moment(cipher, row.kwargs, row.branch)},
        )
        for row in due
        if row.classpath != ALL_OF
    ]
    resumed = _resumed(session, cipher, events)
    all_of = [row.trigger_id for row in due if row.classpath == ALL_OF]
    if all_of:
        session.execute(_DROP_TIMERS_SQL, {"ids": all_of})
        for trigger_id in all_of:
            resumed += _complete_all_of(session, cipher, trigger_id)
    return resumed


# Heartbeats missed: a page of callback_heartbeat rows past due, earliest first
# (ix_callback_heartbeat_due_at), their waiting tasks locked as every resume locks them first
# (a task a send or an answer holds is skipped: the next pass finds it if it still waits). A
# row whose trigger no task waits on any more is deleted here, as the timer pass does.
_MISSED_SQL = text(
    """
    WITH due AS MATERIALIZED (
        SELECT trigger_id, key, every_sec FROM callback_heartbeat
        WHERE due_at <= now()
        ORDER BY due_at
        LIMIT :limit
    ), unwaited AS (
        DELETE FROM callback_heartbeat AS h USING due
        WHERE h.trigger_id = due.trigger_id AND h.key = due.key AND NOT EXISTS (
            SELECT FROM task_instance AS ti
            WHERE ti.trigger_id = due.trigger_id AND ti.state = 'deferred')
    )
    SELECT due.trigger_id, due.every_sec
    FROM due
    JOIN task_instance AS ti ON ti.trigger_id = due.trigger_id AND ti.state = 'deferred'
    ORDER BY ti.id
    FOR UPDATE OF ti SKIP LOCKED
    """
)
# A beat pushes the deadline on only while it has not passed (a missed one stays missed).
_BEAT_SQL = text(
    "UPDATE callback_heartbeat SET due_at = now() + every_sec * interval '1 second'"
    " WHERE key = :key AND due_at > now() RETURNING due_at"
)


def missed_heartbeat_message(every: dt.timedelta) -> str:
    """The one line a task whose callback stopped beating fails with."""
    return (
        f"callback heartbeat missed: no heartbeat posted within {every}"
        f" (CallbackTrigger(heartbeat={every!r}))"
    )


def fail_missed_heartbeats(session: Session, cipher: Cipher, limit: int = TIMER_PAGE) -> list[int]:
    """Fail (or retry, by their retries) the tasks whose callback missed its heartbeat, at most
    ``limit``: each resumes at ``__fail__`` with a message naming the heartbeat. Returns the
    task instances moved."""
    # One event per trigger (a composite may hold two callbacks that beat).
    due = {row.trigger_id: row for row in session.execute(_MISSED_SQL, {"limit": limit})}
    events = [
        transitions.FiredEvent(
            f"heartbeat:{row.trigger_id}",
            row.trigger_id,
            True,
            {"message": missed_heartbeat_message(dt.timedelta(seconds=row.every_sec))},
        )
        for row in due.values()
    ]
    return _resumed(session, cipher, events)


def beat(session: Session, key: str) -> dt.datetime | None:
    """A heartbeat of the callback ``key`` (of a verified token): its deadline pushed on by its
    interval; None if no wait of that key beats, or its deadline has passed."""
    due: dt.datetime | None = session.scalar(_BEAT_SQL, {"key": key})
    return due


# The asset keys a batch of successes may record events of: its tasks' outlets, as parsed.
_OUTLET_KEYS_SQL = text(
    """
    SELECT DISTINCT o.asset_name FROM task_instance AS ti
    JOIN task_outlet_asset AS o ON o.dag_id = ti.dag_id AND o.task_id = ti.task_id
    WHERE ti.id = ANY(CAST(:ids AS bigint[]))
    """
)


def lock_batch_keys(
    session: Session,
    succeeding: Collection[int],
    alias_assets: Iterable[str],
    wait_keys: Collection[str],
) -> None:
    """Before a batch that records successes (task instance ids ``succeeding``, with events
    added through aliases to ``alias_assets``) and deferrals holding rows (their keys
    ``wait_keys``) in one transaction: every key it will take, locked in one statement, so
    that the later locks of the success (its assets) and of the deferrals (their keys) take
    nothing new and two batches cannot take them in opposite orders. A batch without both
    takes its keys in one statement anyway: nothing is done."""
    if not succeeding or not wait_keys:
        return
    assets = set(session.scalars(_OUTLET_KEYS_SQL, {"ids": list(succeeding)})) | set(alias_assets)
    lock_keys(session, [*wait_keys, *(asset_key(name) for name in assets)])


_WAITERS_OF_KEY_SQL = text(
    """
    SELECT sw.trigger_id, sw.branch, sw.cancels, t.classpath = :all_of AS all_of
    FROM signal_wait AS sw JOIN trigger AS t ON t.id = sw.trigger_id
    WHERE sw.key = :key AND sw.fired IS NULL
    ORDER BY sw.trigger_id, sw.branch
    """
)


def resolve(session: Session, cipher: Cipher, key: str, dedup: str, payload: Any) -> list[int]:
    """Fire the waits on ``key`` (an approval's: one task, whose row the caller locked) with
    ``payload``, as a send fires a signal's. Returns the task instances moved."""
    fired = [
        (
            Hit(row.trigger_id, row.branch, row.cancels, bool(row.all_of)),
            transitions.FiredEvent(f"{dedup}:{row.trigger_id}", row.trigger_id, False, payload),
        )
        for row in session.execute(_WAITERS_OF_KEY_SQL, {"key": key, "all_of": ALL_OF})
    ]
    return list(apply(session, cipher, fired, "approval"))


# Asset events just recorded (their asset's uri beside them), the first of each asset.
_ASSET_EVENTS_SQL = text(
    """
    SELECT DISTINCT ON (e.asset_name) e.id, e.asset_name, coalesce(a.uri, e.asset_name) AS uri,
           e.extra, e.timestamp
    FROM asset_event AS e LEFT JOIN asset AS a ON a.name = e.asset_name
    WHERE e.id = ANY(CAST(:ids AS bigint[]))
    ORDER BY e.asset_name, e.id
    """
)
# The waits of those assets not fired yet (ix_signal_wait_key), read once their keys are locked.
_ASSET_WAITERS_SQL = text(
    """
    SELECT sw.key, sw.trigger_id, sw.branch, sw.cancels, t.classpath = :all_of AS all_of
    FROM signal_wait AS sw JOIN trigger AS t ON t.id = sw.trigger_id
    WHERE sw.key = ANY(CAST(:keys AS text[])) AND sw.fired IS NULL
    ORDER BY sw.trigger_id, sw.branch
    """
)


def resume_asset_waiters(session: Session, cipher: Cipher, event_ids: Sequence[int]) -> list[int]:
    """Resume the tasks waiting on the assets of the events ``event_ids`` just recorded in
    ``session``'s transaction (``AssetEventTrigger``, alone or as a branch), each with its
    asset's first event among them: ``{"id", "name", "uri", "extra", "timestamp"}``. Every
    insert of an asset event comes here in its transaction. Returns the task instances
    moved."""
    if not event_ids:
        return []
    events = {
        asset_key(row.asset_name): row
        for row in session.execute(_ASSET_EVENTS_SQL, {"ids": list(event_ids)})
    }
    lock_keys(session, events)
    fired = []
    for row in session.execute(_ASSET_WAITERS_SQL, {"keys": list(events), "all_of": ALL_OF}):
        event = events[row.key]
        payload = {
            "id": event.id,
            "name": event.asset_name,
            "uri": event.uri,
            "extra": dict(event.extra or {}),
            "timestamp": event.timestamp,
        }
        fired.append(
            (
                Hit(row.trigger_id, row.branch, row.cancels, bool(row.all_of)),
                transitions.FiredEvent(
                    f"asset:{event.id}:{row.trigger_id}", row.trigger_id, False, payload
                ),
            )
        )
    return list(apply(session, cipher, fired, "asset event"))
