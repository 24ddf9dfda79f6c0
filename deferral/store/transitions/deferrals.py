"""Deferral: a task hands its wait to a trigger and leaves its worker; the event
(or the timeout) resumes it."""

from __future__ import annotations

import datetime as dt
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import delete, func, select, text
from sqlalchemy.orm import Session

from deferral.runtime.crypto import Cipher, Purpose
from deferral.states import FAIL_METHOD, TaskState
from deferral.store.tables import TaskInstance, Trigger
from deferral.store.tasklogs import NewLine
from deferral.store.transitions import from_trigger, shared
from deferral.store.transitions.attempts import _END_OF_ATTEMPT, Attempt
from deferral.store.transitions.core import _expire_loaded, _move

# Reasons recorded when a task leaves the deferred state; the triggerer reads them to tell why
# the trigger it runs is no longer wanted.
TIMED_OUT = "trigger timeout passed"


RESUMED_BY_TRIGGER = "trigger "  # "trigger <id> fired" / "trigger <id> failed"


def create_trigger(session: Session, classpath: str, kwargs_token: str) -> int:
    trigger = Trigger(classpath=classpath, kwargs=kwargs_token)
    session.add(trigger)
    session.flush()
    return trigger.id


def drop_trigger(session: Session, trigger_id: int) -> None:
    """Delete a trigger no task waits on (its deferral did not happen)."""
    session.execute(delete(Trigger).where(Trigger.id == trigger_id))


@dataclass(frozen=True)
class Deferral:
    """What one attempt's deferral writes: its trigger row and the task's resume point."""

    attempt: Attempt
    classpath: str
    kwargs_token: str  # the trigger's kwargs, sealed
    next_method: str
    next_kwargs_token: str
    trigger_timeout: dt.datetime | None
    # Of a shared trigger (its class says ``shared = True``): the key equal ones meet on.
    share_key: str | None = None
    # Of a time trigger due beyond the horizon: its moment; its entry is published only once
    # the moment comes within the horizon (deferral.store.far_timers).
    far_moment: dt.datetime | None = None


def defer(
    session: Session,
    attempt: Attempt,
    *,
    trigger_id: int,
    next_method: str,
    next_kwargs_token: str,
    trigger_timeout: dt.datetime | None,
) -> bool:
    """running -> deferred, waiting on an existing trigger row ``trigger_id``."""
    return bool(
        _move(
            session,
            [attempt.task_instance_id],
            TaskState.RUNNING,
            TaskState.DEFERRED,
            f"deferred to trigger {trigger_id}",
            fence=attempt.fence(),
            trigger_id=trigger_id,
            next_method=next_method,
            next_kwargs=next_kwargs_token,
            next_event=None,
            trigger_timeout=trigger_timeout,
        )
    )


# running -> deferred for a batch (fenced on try and worker): the rows locked, a trigger row
# for each that moves (its id drawn first, so that each task gets its own), the moves and their
# records; one statement, on every deferral's path. Nothing is written for an attempt that no
# longer holds its task instance.
_DEFER_SQL = text(
    """
    WITH deferral AS (
        SELECT * FROM unnest(
            CAST(:ids AS bigint[]), CAST(:tries AS integer[]), CAST(:workers AS text[]),
            CAST(:next_methods AS text[]), CAST(:next_kwargs AS text[]),
            CAST(:timeouts AS timestamptz[]), CAST(:classpaths AS text[]),
            CAST(:kwargs AS text[]), CAST(:far_moments AS timestamptz[])
        ) AS d (id, try_number, worker, next_method, next_kwargs, trigger_timeout, classpath,
                kwargs, far_moment)
    ), held AS (
        SELECT ti.id FROM task_instance AS ti
        JOIN deferral AS d ON ti.id = d.id AND ti.try_number = d.try_number
            AND ti.worker = d.worker
        WHERE ti.state = 'running'
        ORDER BY ti.id
        FOR UPDATE OF ti
    ), planned AS (
        SELECT d.*, nextval(pg_get_serial_sequence('trigger', 'id')) AS trigger_id
        FROM deferral AS d JOIN held ON held.id = d.id
    ), triggers AS (
        INSERT INTO trigger (id, classpath, kwargs, far_moment)
        SELECT trigger_id, classpath, kwargs, far_moment FROM planned
    ), moved AS (
        UPDATE task_instance AS ti
        SET state = 'deferred', trigger_id = p.trigger_id, next_method = p.next_method,
            next_kwargs = p.next_kwargs, next_event = NULL, trigger_timeout = p.trigger_timeout,
            updated_at = now()
        FROM planned AS p
        WHERE ti.id = p.id
        RETURNING ti.id, ti.trigger_id
    ), recorded AS (
        INSERT INTO task_state_change (task_instance_id, from_state, to_state, reason)
        SELECT id, 'running', 'deferred', 'deferred to trigger ' || trigger_id
        FROM moved ORDER BY id
    )
    SELECT id, trigger_id FROM moved
    """
)


def defer_many(
    session: Session, deferrals: Sequence[Deferral], joined: set[int] | None = None
) -> dict[int, int]:
    """running -> deferred for a batch, each with a new trigger row, in one statement; returns
    task instance id -> trigger id for those that moved. A shared deferral (with a share key)
    joins the row of its key instead, if there is one, and its task id goes into ``joined``."""
    sharing = [d for d in deferrals if d.share_key is not None]
    done: dict[int, int] = {}
    if sharing:
        params = {**_defer_params(sharing), "share_keys": [d.share_key for d in sharing]}
        done = shared.defer_shared(session, params, set() if joined is None else joined)
    deferrals = [d for d in deferrals if d.share_key is None]
    if not deferrals:
        return done
    params = _defer_params(deferrals)
    moved = {ti_id: trigger_id for ti_id, trigger_id in session.execute(_DEFER_SQL, params)}
    _expire_loaded(session, moved)
    return done | moved


def _defer_params(deferrals: Sequence[Deferral]) -> dict[str, list[Any]]:
    return {
        "ids": [d.attempt.task_instance_id for d in deferrals],
        "tries": [d.attempt.try_number for d in deferrals],
        "workers": [d.attempt.worker for d in deferrals],
        "next_methods": [d.next_method for d in deferrals],
        "next_kwargs": [d.next_kwargs_token for d in deferrals],
        "timeouts": [d.trigger_timeout for d in deferrals],
        "classpaths": [d.classpath for d in deferrals],
        "kwargs": [d.kwargs_token for d in deferrals],
        "far_moments": [d.far_moment for d in deferrals],
    }


@dataclass(frozen=True)
class FiredEvent:
    dedup_key: str
    trigger_id: int
    failed: bool  # the trigger failed (raised, ended without an event, could not be built)
    payload: Any  # the event payload, or for a failure {"error": ..., "traceback": ...}
    # The triggerer's lines for the try's log, stored by whoever applies the event.
    log: tuple[NewLine, ...] = ()
    # The payload sealed as the triggerer sent it, stored as it is (else sealed here).
    sealed_payload: str | None = None
    # A task-end event's kind (end_from_trigger): its tasks end, with payload["xcoms"].
    ends: str | None = None


@dataclass(frozen=True)
class Resumed:
    """What an event did: its outcome as recorded in resume_event (applied, duplicate, stale)
    and the task instance it resumed, if it did."""

    outcome: str
    task_instance_id: int | None = None
    # The other tasks it resumed: those waiting on the same shared trigger.
    others: tuple[int, ...] = ()

    def ids(self) -> list[int]:
        """Every task it resumed (or ended)."""
        first = [] if self.task_instance_id is None else [self.task_instance_id]
        return first + list(self.others)


def resume(session: Session, event: FiredEvent, cipher: Cipher) -> Resumed:
    """:func:`resume_many` for one event."""
    return resume_many(session, [event], cipher)[0]


def resume_point(
    event: FiredEvent, next_method: str | None, next_kwargs: dict[str, Any]
) -> tuple[str | None, dict[str, Any]]:
    """The method and kwargs a task that deferred with ``next_method`` and ``next_kwargs``
    resumes at when ``event`` fires: the method with the event, or ``__fail__`` with the
    trigger's failure."""
    if event.failed:
        return FAIL_METHOD, {"error": "trigger_failure", **event.payload}
    return next_method, {**next_kwargs, "event": event.payload}


def _sealed_event(event: FiredEvent, cipher: Cipher) -> str | None:
    """The sealed payload a task resumed by ``event`` finds beside the kwargs it deferred with,
    which stay as they were sealed (nothing is opened and sealed again here); None for an event
    that does not resume at the deferral's method (a failure, a task end)."""
    if event.failed or event.ends is not None:
        return None
    return event.sealed_payload or cipher.seal(Purpose.EVENT, event.payload, "event")


def _resumed_by_failure(event: FiredEvent, cipher: Cipher) -> tuple[str, str, None, str]:
    """(next_method, sealed next_kwargs, next_event, reason) of a task whose trigger failed:
    ``__fail__`` with the failure."""
    kwargs = {"error": "trigger_failure", **event.payload}
    reason = f"{RESUMED_BY_TRIGGER}{event.trigger_id} failed"
    return FAIL_METHOD, cipher.seal(Purpose.RESUME_KWARGS, kwargs, "next_kwargs"), None, reason


# The kwargs a task whose deferral timed out resumes at ``__fail__`` with.
TIMED_OUT_KWARGS = {"error": "timeout"}


# How far back a dedup key is looked for (resume_event is partitioned by day: a look back
# bounded on both sides reads only the last day's partitions, not the default one nor those
# made ahead). An older duplicate finds its trigger gone and is claimed as stale: a task resumes
# at most once whatever the window, as only a task deferred on the event's trigger resumes.
DEDUP_WINDOW = dt.timedelta(days=1)

# Lock the tasks deferred on the events' triggers, then claim each event's dedup key (a key seen
# before claims nothing: a duplicate) with its outcome already decided: applied by the first
# event of a trigger whose task waits, stale for the others. The key is claimed before the task
# is touched, and written once: no second write to say it applied. An applied event that
# resumes its tasks at their method (``event`` given: its sealed payload) resumes them here,
# their change recorded and their trigger dropped; a failure or a task end is left to the
# statements after (the rows say who waits). One statement on every resume's path (a second
# one cost a round trip and a plan on idle_runs' fire -> SCHEDULED). Plain SQL, as for
# every statement on the resume path: it runs once per batch of events, and building it with
# the ORM cost more than executing it. The waiters are found by their trigger ids alone
# (``state || ''`` keeps the planner off the state indexes: with statistics taken before a burst
# of deferrals it reckoned 'deferred' rare and read every deferred task in id order per claim).
_CLAIM_EVENTS_SQL = text(
    """
    WITH fired AS (
        SELECT * FROM unnest(CAST(:dedup_keys AS text[]), CAST(:trigger_ids AS bigint[]),
                             CAST(:events AS text[]), CAST(:reasons AS text[]))
            WITH ORDINALITY AS f (dedup_key, trigger_id, event, reason, n)
    ), waiting AS (
        SELECT id, trigger_id, next_method, next_kwargs FROM task_instance
        WHERE trigger_id = ANY(CAST(:trigger_ids AS bigint[])) AND state || '' = 'deferred'
        ORDER BY id
        FOR UPDATE
    ), appliers AS (
        SELECT DISTINCT ON (fired.trigger_id) fired.dedup_key, waiting.id
        FROM fired JOIN waiting ON waiting.trigger_id = fired.trigger_id
        ORDER BY fired.trigger_id, fired.n
    ), claimed AS (
        INSERT INTO resume_event (dedup_key, trigger_id, outcome, task_instance_id)
        SELECT fired.dedup_key, fired.trigger_id,
               CASE WHEN appliers.id IS NULL THEN 'stale' ELSE 'applied' END, appliers.id
        FROM fired LEFT JOIN appliers ON appliers.dedup_key = fired.dedup_key
        WHERE NOT EXISTS (
            SELECT 1 FROM resume_event seen
            WHERE seen.dedup_key = fired.dedup_key
              AND seen.received_at BETWEEN now() - CAST(:dedup_window AS interval) AND now())
        ORDER BY fired.n
        ON CONFLICT DO NOTHING
        RETURNING dedup_key, task_instance_id, trigger_id
    ), resumed AS (
        UPDATE task_instance AS ti
        SET state = 'scheduled', trigger_id = NULL, trigger_timeout = NULL,
            next_event = fired.event, updated_at = now()
        FROM claimed JOIN fired ON fired.dedup_key = claimed.dedup_key
        WHERE claimed.task_instance_id IS NOT NULL AND fired.event IS NOT NULL
            AND ti.trigger_id = claimed.trigger_id AND ti.id IN (SELECT id FROM waiting)
        RETURNING ti.id, fired.reason, claimed.trigger_id
    ), recorded AS (
        INSERT INTO task_state_change (task_instance_id, from_state, to_state, reason)
        SELECT id, 'deferred', 'scheduled', reason FROM resumed ORDER BY id
    ), dropped AS (
        DELETE FROM trigger WHERE id IN (SELECT trigger_id FROM resumed)
    )
    SELECT claimed.dedup_key, waiting.id, waiting.next_method, waiting.next_kwargs
    FROM claimed LEFT JOIN waiting
        ON claimed.task_instance_id IS NOT NULL AND waiting.trigger_id = claimed.trigger_id
    """
)


# deferred -> scheduled at ``__fail__`` for the locked tasks of failed triggers, their change
# recorded, their triggers dropped: one statement.
_RESUME_SQL = text(
    """
    WITH resumed AS (
        UPDATE task_instance AS ti
        SET state = 'scheduled', trigger_id = NULL, trigger_timeout = NULL,
            next_method = r.next_method, next_kwargs = r.next_kwargs,
            next_event = r.next_event, updated_at = now()
        FROM unnest(
            CAST(:ids AS bigint[]), CAST(:next_methods AS text[]), CAST(:next_kwargs AS text[]),
            CAST(:next_events AS text[]), CAST(:reasons AS text[]), CAST(:trigger_ids AS bigint[])
        ) AS r (id, next_method, next_kwargs, next_event, reason, trigger_id)
        WHERE ti.id = r.id
        RETURNING ti.id, r.reason, r.trigger_id
    ), recorded AS (
        INSERT INTO task_state_change (task_instance_id, from_state, to_state, reason)
        SELECT id, 'deferred', 'scheduled', reason FROM resumed ORDER BY id
    )
    DELETE FROM trigger WHERE id IN (SELECT trigger_id FROM resumed)
    """
)


def resume_many(
    session: Session, events: Sequence[FiredEvent], cipher: Cipher, *, shared_locked: bool = False
) -> list[Resumed]:
    """deferred -> scheduled for the tasks waiting on the events' triggers, at most once per
    dedup key, in one statement whatever the batch size once the shared triggers are locked
    (``shared_locked``: by an earlier statement of the transaction; the tasks of failed triggers
    take a second, and each task end its own). Returns what each event did:
    applied, duplicate (key seen before) or stale (its task was cleared, timed out, or resumed
    by an earlier event)."""
    if not events:
        return []
    outcomes = [Resumed("duplicate")] * len(events)
    first: dict[str, int] = {}
    for index, event in enumerate(events):
        first.setdefault(event.dedup_key, index)
    keys = list(first)
    trigger_ids = [events[first[k]].trigger_id for k in keys]
    sealed = [_sealed_event(events[first[k]], cipher) for k in keys]
    if not shared_locked:
        shared.lock_shared(session, trigger_ids)
    # Every task waiting on an applied event's trigger (several for a shared one), by key.
    claimed: dict[str, list[Any]] = {}
    params = {
        "dedup_keys": keys,
        "trigger_ids": trigger_ids,
        "events": sealed,
        "reasons": [f"{RESUMED_BY_TRIGGER}{trigger_id} fired" for trigger_id in trigger_ids],
        "dedup_window": DEDUP_WINDOW,
    }
    for row in session.execute(_CLAIM_EVENTS_SQL, params):
        claimed.setdefault(row.dedup_key, []).append(row)
    moves: dict[str, list[Any]] = {
        name: []
        for name in ("ids", "next_methods", "next_kwargs", "next_events", "reasons", "trigger_ids")
    }
    for key in sorted(claimed, key=first.__getitem__):
        rows = claimed[key]
        if rows[0].id is None:  # claimed as stale
            outcomes[first[key]] = Resumed("stale")
            continue
        event = events[first[key]]
        ids = sorted(row.id for row in rows)
        if event.ends is not None:  # the tasks end here, no worker resumes them
            xcoms = event.payload["xcoms"]
            from_trigger.end_from_trigger(session, ids, event.trigger_id, event.ends, xcoms)
            outcomes[first[key]] = Resumed("ended", ids[0], tuple(ids[1:]))
            continue
        if event.failed:
            for row in rows:
                values = (row.id, *_resumed_by_failure(event, cipher), event.trigger_id)
                for name, value in zip(moves, values, strict=True):
                    moves[name].append(value)
        outcomes[first[key]] = Resumed("applied", ids[0], tuple(ids[1:]))
    if moves["ids"]:
        session.execute(_RESUME_SQL, moves)
    return outcomes


_EXPIRE_SQL = """
    WITH expired AS (
        UPDATE task_instance AS ti
        SET state = 'scheduled', trigger_id = NULL, trigger_timeout = NULL,
            next_method = :fail_method, next_kwargs = :fail_kwargs, next_event = NULL,
            updated_at = now()
        FROM (
            SELECT id, trigger_id FROM task_instance
            WHERE state = 'deferred' AND trigger_timeout < now() {among}
            ORDER BY trigger_timeout
            LIMIT :limit
            FOR UPDATE SKIP LOCKED
        ) AS old
        WHERE ti.id = old.id
        RETURNING ti.id, old.trigger_id
    ), recorded AS (
        INSERT INTO task_state_change (task_instance_id, from_state, to_state, reason)
        SELECT id, 'deferred', 'scheduled', :reason FROM expired
    ), dropped AS (
        DELETE FROM trigger WHERE id IN (SELECT trigger_id FROM expired) AND share_key IS NULL
    )
    SELECT id FROM expired
    """


_EXPIRE_ALL_SQL = text(_EXPIRE_SQL.format(among=""))


_EXPIRE_AMONG_SQL = text(_EXPIRE_SQL.format(among="AND id = ANY(CAST(:among AS bigint[]))"))


def expire_deferrals(
    session: Session, cipher: Cipher, limit: int = 10_000, among: Collection[int] | None = None
) -> list[int]:
    """deferred -> scheduled at ``__fail__`` for every task (``among`` these ids, if given)
    whose trigger_timeout passed, in one statement; the worker then raises TaskDeferralTimeout
    inside the task."""
    token = cipher.seal(Purpose.RESUME_KWARGS, TIMED_OUT_KWARGS, "next_kwargs")
    params = {"fail_method": FAIL_METHOD, "fail_kwargs": token, "limit": limit, "reason": TIMED_OUT}
    if among is None:
        return list(session.scalars(_EXPIRE_ALL_SQL, params))
    return list(session.scalars(_EXPIRE_AMONG_SQL, {**params, "among": list(among)}))


# The reason a cancel-on records ("cancelled by signal <id> on <key>"): neither a timeout nor a
# resume to the triggerer (triggerer.decide.cancel_reason), which calls the running trigger's
# on_kill() as for a user's action.
CANCELLED_BY = "cancelled by "


def cancel_waiting(
    session: Session, trigger_id: int, to_state: TaskState, reason: str
) -> list[int]:
    """deferred -> ``to_state`` (skipped or failed) for the task still deferred on
    ``trigger_id`` (a cancel-on's event came first), which lets go of its trigger (its rows go
    with it). Returns the ids moved: none once the task resumed, timed out or was cleared."""
    waiting = session.scalars(
        select(TaskInstance.id)
        .where(TaskInstance.trigger_id == trigger_id, TaskInstance.state == TaskState.DEFERRED)
        .order_by(TaskInstance.id)
        .with_for_update()
    ).all()
    moved = _move(
        session,
        waiting,
        TaskState.DEFERRED,
        to_state,
        f"{CANCELLED_BY}{reason}",
        fence=[TaskInstance.trigger_id == trigger_id],
        trigger_id=None,
        end_date=func.now(),
        **_END_OF_ATTEMPT,
    )
    if moved:
        session.execute(
            delete(Trigger).where(Trigger.id == trigger_id, Trigger.share_key.is_(None))
        )
    return moved
