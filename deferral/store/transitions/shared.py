"""Shared triggers: tasks that defer on equal triggers of a class that opts in (``shared =
True``) wait on one trigger row, so one trigger runs for all of them and its event resumes each.

The row is found by ``trigger.share_key``, a keyed digest of the classpath and kwargs (see
:func:`share_key`): equal deferrals meet on it without anyone comparing sealed kwargs, and the
table shows nothing a guess could be checked against. Who may touch a shared row, and in what
order, is what keeps a waiter joining and the trigger firing (or its last waiter leaving) apart:
every writer locks the trigger row first. A joiner locks it by its upsert; the resume path
(:func:`lock_shared`) and the sweep (:func:`drop_unwaited`) lock it and only then, in a new
statement (a new snapshot), read its waiters. So a joiner either committed before (and is
resumed with the others) or waits for the row to go and makes a new one (whose moment, for a
time trigger, has passed: it fires at once)."""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

import msgspec
from sqlalchemy import text
from sqlalchemy.orm import Session

from deferral.runtime.crypto import Cipher
from deferral.store.transitions.core import _expire_loaded

_SHARE_CONTEXT = b"deferral shared trigger key v1"


def share_key(cipher: Cipher, classpath: str, kwargs: Any) -> str:
    """The key equal shared deferrals meet on: classpath and kwargs (their JSON form, keys
    sorted) under a key derived from the Fernet key. Rotating the key starts new rows for new
    deferrals; those waiting keep theirs."""
    data = msgspec.json.encode([classpath, kwargs], order="sorted")
    return cipher.keyed_digest(data, _SHARE_CONTEXT)


# running -> deferred for a batch of shared deferrals: the rows locked (fenced on try and worker),
# one trigger row per share key found or made (an upsert, which locks it until commit), the moves
# and their records. The upsert's ``DO UPDATE`` (to nothing new) is what returns the id of a row
# that already existed, and locks it against a resume or sweep racing the join.
_DEFER_SHARED_SQL = text(
    """
    WITH deferral AS (
        SELECT * FROM unnest(
            CAST(:share_keys AS text[]),
            CAST(:ids AS bigint[]),
            CAST(:tries AS integer[]),
            CAST(:workers AS text[]),
            CAST(:next_methods AS text[]),
            CAST(:next_kwargs AS text[]),
            CAST(:timeouts AS timestamptz[]),
            CAST(:classpaths AS text[]),
            CAST(:kwargs AS text[]),
            CAST(:far_moments AS timestamptz[])
        ) AS d (share_key, id, try_number, worker, next_method, next_kwargs, trigger_timeout,
                classpath, kwargs, far_moment)
    ), planned AS (
        -- The attempts that still hold their task instance, locked in id order.
        SELECT d.* FROM task_instance AS ti, deferral AS d
        WHERE ti.id = d.id AND ti.try_number = d.try_number AND ti.worker = d.worker
            AND ti.state = 'running'
        ORDER BY ti.id
        FOR UPDATE OF ti
    ), triggers AS (
        INSERT INTO trigger (classpath, kwargs, share_key, far_moment)
        SELECT DISTINCT ON (share_key) classpath, kwargs, share_key, far_moment FROM planned
        ORDER BY share_key
        ON CONFLICT (share_key) DO UPDATE SET share_key = EXCLUDED.share_key
        RETURNING id, share_key, xmax = 0 AS made
    ), moved AS (
        UPDATE task_instance AS ti
        SET state = 'deferred', trigger_id = t.id, next_method = p.next_method,
            next_kwargs = p.next_kwargs, next_event = NULL, trigger_timeout = p.trigger_timeout,
            updated_at = now()
        FROM planned AS p JOIN triggers AS t ON t.share_key = p.share_key
        WHERE ti.id = p.id
        RETURNING ti.id, ti.trigger_id, t.made
    ), recorded AS (
        INSERT INTO task_state_change (task_instance_id, from_state, to_state, reason)
        SELECT id, 'running', 'deferred', 'deferred to trigger ' || trigger_id
        FROM moved ORDER BY id
    )
    SELECT id, trigger_id, made FROM moved ORDER BY id
    """
)


def defer_shared(
    session: Session, params: Mapping[str, list[Any]], joined: set[int]
) -> dict[int, int]:
    """running -> deferred for deferrals that carry a share key (``params``: as
    ``deferrals.defer_many`` builds them, with ``share_keys``), each onto the trigger row of its
    key (made if none exists); returns task instance id -> trigger id for those that moved, and
    adds to ``joined`` those that found their trigger already made (by an earlier deferral, or
    by another of this batch): their trigger's entry is already published."""
    done: dict[int, int] = {}
    published: set[int] = set()  # the made triggers whose entry a task of this batch publishes
    for ti_id, trigger_id, made in session.execute(_DEFER_SHARED_SQL, params):
        if made and trigger_id not in published:
            published.add(trigger_id)
        else:
            joined.add(ti_id)
        done[ti_id] = trigger_id
    _expire_loaded(session, done)
    return done


_LOCK_SHARED_SQL = text(
    "SELECT id FROM trigger WHERE id = ANY(CAST(:ids AS bigint[])) AND share_key IS NOT NULL"
    " ORDER BY id FOR UPDATE"
)


def lock_shared(session: Session, trigger_ids: Collection[int]) -> None:
    """Lock the shared ones among ``trigger_ids`` before their waiters are read (in a later
    statement): no task joins them until this transaction ends."""
    session.execute(_LOCK_SHARED_SQL, {"ids": list(trigger_ids)})


# A page of the shared trigger rows after id :after (ix_trigger_shared_id), and of those the
# ones no task waits on any more (their waiters were cleared, marked or timed out: those paths
# leave a shared row alone, as others may still wait on it), locked, skipping any a joiner
# holds; then deleted in a second statement if still unwaited. The page's last id, when the page
# is full, is where the next page starts. A page at a time: the sweep once read every shared
# row and probed its waiters each second (0.6-1.0 s with 10,000 runs waiting on shared ones).
_UNWAITED_SQL = text(
    """
    WITH page AS MATERIALIZED (
        SELECT id FROM trigger WHERE share_key IS NOT NULL AND id > :after
        ORDER BY id LIMIT :page
    ), unwaited AS (
        SELECT t.id FROM trigger AS t
        WHERE t.id IN (SELECT id FROM page) AND t.share_key IS NOT NULL
            AND NOT EXISTS (SELECT 1 FROM task_instance AS ti WHERE ti.trigger_id = t.id)
        ORDER BY t.id
        FOR UPDATE OF t SKIP LOCKED
    )
    SELECT 'unwaited' AS kind, id FROM unwaited
    UNION ALL
    SELECT 'last', max(id) FROM page HAVING count(*) = :page
    """
)

_DROP_UNWAITED_SQL = text(
    """
    DELETE FROM trigger AS t
    WHERE t.id = ANY(CAST(:ids AS bigint[]))
        AND NOT EXISTS (SELECT 1 FROM task_instance AS ti WHERE ti.trigger_id = t.id)
    RETURNING t.id
    """
)


def drop_unwaited(session: Session, after: int = 0, page: int = 1000) -> tuple[list[int], int]:
    """Delete the shared trigger rows whose last waiter left among the ``page`` shared rows
    after id ``after``; returns their ids and where the next page starts (0: from the first
    again). The triggerer running one has already cancelled it (it checks for waiters each
    beat)."""
    ids, last = [], 0
    for kind, trigger_id in session.execute(_UNWAITED_SQL, {"after": after, "page": page}):
        if kind == "last":
            last = trigger_id
        else:
            ids.append(trigger_id)
    if not ids:
        return [], last
    return list(session.scalars(_DROP_UNWAITED_SQL, {"ids": ids})), last
