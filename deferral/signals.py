"""Signals: ``send(key, payload)`` resumes every task waiting on ``key`` (``SignalTrigger``)
with ``payload``; the signal is recorded so that a wait created later with a lookback finds it.

A wait is a ``signal_wait`` row beside its trigger row, not a trigger run in a triggerer: a send
resumes the waiters in its own transaction, through the resume path events take
(``transitions.resume_many``, deduplicated by signal and trigger). The write of a signal and the
creation of a wait on the same key are serialized by a transaction-scoped advisory lock on the
key, so a wait either sees a signal (lookback) or is seen by it (a later send): none is lost
between the two.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import ColumnElement, ColumnExpressionArgument, TextClause, select, text
from sqlalchemy.orm import Session

from deferral.runtime import serialization, storable
from deferral.runtime.crypto import Cipher, Purpose
from deferral.runtime.serialization import SerializationError
from deferral.store.seam import (
    CALLBACK_KEY_PREFIX,
    TOKEN_LIFETIME,
    Claim,
    InputRequest,
    SignalWait,
    TokenRefused,
    WaitTimer,
    check_request,
    idempotency,
    metastore,
    parse_token,
    pipelined,
    record_request,
    transitions,
    waits,
)
from deferral.triggers.approval import APPROVAL_KEY_PREFIX, APPROVAL_TRIGGER, approval_key
from deferral.triggers.asset_event import ASSET_TRIGGER, asset_key, check_asset_name
from deferral.triggers.composite import (
    ALL_OF,
    APPROVAL,
    ASSET,
    BRANCHES,
    CALLBACK,
    COMPOSITES,
    RUNNING,
    SIGNAL,
    branch_kind,
)
from deferral.triggers.signal import (
    CALLBACK_TRIGGER,
    SIGNAL_RETENTION,
    SIGNAL_TRIGGER,
    SignalError,
    check_heartbeat,
    check_lookback,
    check_signal_key,
    where_predicate,
)

IdempotencyConflict = idempotency.IdempotencyConflict

__all__ = ["MAX_PAYLOAD_BYTES", "IdempotencyConflict", "SentSignal", "SignalError", "send"]

# Most bytes of a payload's JSON.
MAX_PAYLOAD_BYTES = 64 * 1024
SUCCESS, FAILURE = "success", "failure"
# A callback is taken while its task runs the token's try (it has not deferred yet: the answer
# waits for it) or waits.
_ANSWERABLE = ("running", "deferred")
# Old signals each send deletes at most (they go at least as fast as signals come). Aged by
# now(), which is stable within the statement, so the index on sent_at serves it (a volatile
# clock_timestamp() would make it a scan of the whole table on every send).
PRUNE_PER_SEND = 100
# Rows a sender's count is kept in: a send adds to the one of its connection's server process,
# so concurrent sends of one sender rarely wait on each other's row.
COUNT_STRIPES = 16

# Signals (keys distinct, each sender's at most its ``kept``) recorded in one statement, and
# each one's waiters; the shared triggers among those locked (``transitions.lock_shared``, done
# here: the resume that follows reads their waiters in a later statement). A sender's (web
# user's) oldest signals beyond ``kept`` go, found from its count (``signal_count``, the sum of
# its stripes) without walking the signals it keeps; the count changes by what was inserted and
# deleted. The statement's snapshot does not see the rows it inserts. No sender (NULL): no
# count, nothing matches. Concurrent sends find the same old rows to delete: each takes the
# oldest it can lock at once and leaves the others to the send holding them (waiting, two sends
# deleting several rows each deadlocked).
_SEND_SQL = text(
    """
    WITH given AS (
        SELECT * FROM unnest(
            CAST(:keys AS text[]), CAST(:payloads AS text[]), CAST(:senders AS text[]),
            CAST(:kept AS int[]), CAST(:docs AS text[])
        ) AS g (key, payload, sent_by, kept, doc)
    ), sent AS (
        INSERT INTO signal (key, payload, sent_by) SELECT key, payload, sent_by FROM given
        RETURNING id, key
    ), pruned AS (
        DELETE FROM signal WHERE id IN (
            SELECT id FROM signal WHERE sent_at < now() - :retention
            ORDER BY sent_at LIMIT :prune FOR UPDATE SKIP LOCKED
        )
        RETURNING sent_by
    ), senders AS (
        SELECT g.sent_by, min(g.kept) AS kept, count(*) AS new,
               (SELECT coalesce(sum(c.stored), 0) FROM signal_count AS c
                WHERE c.sent_by = g.sent_by) AS stored
        FROM given AS g WHERE g.sent_by IS NOT NULL GROUP BY g.sent_by
    ), over_quota AS (
        DELETE FROM signal WHERE id = ANY(ARRAY(
            SELECT old.id FROM senders AS q CROSS JOIN LATERAL (
                SELECT id FROM signal WHERE sent_by = q.sent_by AND sent_by IS NOT NULL
                ORDER BY id LIMIT greatest(q.stored + q.new - q.kept, 0)
                FOR UPDATE SKIP LOCKED
            ) AS old
        ))
        RETURNING sent_by
    ), counted AS (
        INSERT INTO signal_count (sent_by, stripe, stored)
        SELECT sent_by, pg_backend_pid() % :stripes, sum(change) FROM (
            SELECT sent_by, new AS change FROM senders
            UNION ALL SELECT sent_by, -1 FROM over_quota
            UNION ALL SELECT sent_by, -1 FROM pruned WHERE sent_by IS NOT NULL
        ) AS c
        GROUP BY sent_by ORDER BY sent_by
        ON CONFLICT (sent_by, stripe) DO UPDATE SET stored = signal_count.stored + EXCLUDED.stored
    ), shared AS (
        SELECT t.id FROM trigger AS t
        WHERE t.share_key IS NOT NULL AND t.id = ANY(ARRAY(
            SELECT trigger_id FROM signal_wait
            WHERE key = ANY(CAST(:keys AS text[])) AND fired IS NULL
        ))
        ORDER BY t.id FOR UPDATE OF t
    )
    SELECT sent.id, sent.key, w.trigger_ids, w.branches, w.cancels, w.all_of,
           (SELECT count(*) FROM shared) AS shared_locked
    FROM sent JOIN given ON given.key = sent.key CROSS JOIN LATERAL (
        SELECT coalesce(array_agg(sw.trigger_id ORDER BY sw.trigger_id, sw.branch), '{}')
                   AS trigger_ids,
               array_agg(sw.branch ORDER BY sw.trigger_id, sw.branch) AS branches,
               array_agg(sw.cancels ORDER BY sw.trigger_id, sw.branch) AS cancels,
               array_agg(t.classpath = :all_of ORDER BY sw.trigger_id, sw.branch) AS all_of
        FROM signal_wait AS sw JOIN trigger AS t ON t.id = sw.trigger_id
        WHERE sw.key = sent.key AND sw.fired IS NULL
            AND (sw.match IS NULL OR CAST(given.doc AS jsonb) @@ CAST(sw.match AS jsonpath))
    ) AS w
    """
)

# The wait rows, and for each with a lookback the latest signal on its key sent within it (the
# signals of a filtered one, newest first, at most LOOKBACK_SCAN: its filter is applied next).
_WAIT_SQL = text(
    """
    WITH rows AS (
        SELECT * FROM unnest(
            CAST(:trigger_ids AS bigint[]), CAST(:keys AS text[]), CAST(:branches AS text[]),
            CAST(:matches AS text[]), CAST(:cancels AS text[]), CAST(:holds AS boolean[]),
            CAST(:lookbacks AS interval[])
        ) AS r (trigger_id, key, branch, match, cancels, holds, lookback)
    ), waits AS (
        INSERT INTO signal_wait (trigger_id, key, branch, match, cancels, holds)
        SELECT trigger_id, key, branch, match, cancels, holds FROM rows
        RETURNING trigger_id, branch, created_at
    )
    SELECT r.trigger_id, r.branch, r.match, s.id, s.payload
    FROM waits AS w
    JOIN rows AS r ON r.trigger_id = w.trigger_id AND r.branch = w.branch
    CROSS JOIN LATERAL (
        SELECT id, payload, sent_at FROM signal
        WHERE key = r.key AND sent_at >= w.created_at - r.lookback
        ORDER BY sent_at DESC, id DESC
        LIMIT CASE WHEN r.match IS NULL THEN 1 ELSE :scan END
    ) AS s
    WHERE r.lookback > interval '0'
    ORDER BY r.trigger_id, r.branch, s.sent_at DESC, s.id DESC
    """
)
# Of the payloads (in order), the first that matches the filter.
_FIRST_MATCH_SQL = text(
    "SELECT n FROM unnest(CAST(:docs AS jsonb[])) WITH ORDINALITY AS p (doc, n)"
    " WHERE doc @@ CAST(:match AS jsonpath) ORDER BY n LIMIT 1"
)
# The signals a filtered wait's lookback reads at most (the newest within it).
LOOKBACK_SCAN = 1000
_NO_LOOKBACK = dt.timedelta(0)


@dataclass(frozen=True)
class SentSignal:
    """A recorded signal and the task instances it resumed; ``replayed``: a repeat of an
    idempotency key, answered with the first send's signal (this one recorded nothing)."""

    id: int
    key: str
    resumed: tuple[int, ...]
    replayed: bool = False

    def answer(self) -> dict[str, Any]:
        return {"id": self.id, "key": self.key, "resumed": list(self.resumed)}

    @classmethod
    def from_outcome(cls, outcome: idempotency.Outcome) -> SentSignal:
        answer = outcome.answer
        return cls(answer["id"], answer["key"], tuple(answer["resumed"]), outcome.replayed)


Wait = waits.Wait


def _checked_json(payload: Any) -> bytes:
    """The payload's JSON; SignalError if it is not JSON-able or larger than MAX_PAYLOAD_BYTES."""
    try:
        storable.check(payload, "signal payload")
        data = serialization.dumps(payload, "signal payload")
    except (SerializationError, storable.UnstorableText) as exc:
        raise SignalError(str(exc)) from None
    if len(data) > MAX_PAYLOAD_BYTES:
        raise SignalError(
            f"signal payload is {len(data)} bytes of JSON, more than {MAX_PAYLOAD_BYTES}"
        )
    return data


def seal_payload(cipher: Cipher, payload: Any) -> str:
    """The payload sealed as a resumed task's event is; SignalError if it is not JSON-able or
    larger than MAX_PAYLOAD_BYTES."""
    return cipher.encrypt(Purpose.SIGNAL_PAYLOAD, _checked_json(payload))


@dataclass(frozen=True)
class _Fired:
    """What a signal resumes its waiters with: for a callback its answer, otherwise the payload
    sealed again as an event (a signal payload's token never serves as another purpose's: its
    plaintext is the sender's choice)."""

    answer: Any
    event_token: str


def _fired(cipher: Cipher, key: str, sealed: str) -> _Fired:
    plain = cipher.decrypt(Purpose.SIGNAL_PAYLOAD, sealed)
    if key.startswith(CALLBACK_KEY_PREFIX):
        return _Fired(serialization.loads(plain), "")
    return _Fired(None, cipher.encrypt(Purpose.EVENT, plain))


def _signal_event(
    signal_id: int, trigger_id: int, key: str, fired: _Fired
) -> transitions.FiredEvent:
    """The event signal ``signal_id`` on ``key`` fires for the wait of trigger ``trigger_id``:
    the payload as sent, or for a callback its payload, or its failure."""
    dedup_key = f"signal:{signal_id}:{trigger_id}"
    if key.startswith(CALLBACK_KEY_PREFIX):
        answer = fired.answer
        failed = answer["status"] == FAILURE
        payload = {"message": failure_message(answer["payload"])} if failed else answer["payload"]
        return transitions.FiredEvent(dedup_key, trigger_id, failed, payload)
    return transitions.FiredEvent(
        dedup_key, trigger_id, False, None, sealed_payload=fired.event_token
    )


@dataclass(frozen=True)
class Sender:
    """Who sends through the web API, and how many of their signals are kept at most (their
    oldest go as they send more: storage stays bounded whatever one user sends)."""

    name: str
    kept: int


def _apply(
    session: Session,
    cipher: Cipher,
    signal_id: int,
    key: str,
    sealed: str,
    hits: Sequence[waits.Hit],
) -> tuple[int, ...]:
    """Resume (or cancel) what signal ``signal_id`` on ``key`` matched."""
    if not hits:
        return ()
    fired = _fired(cipher, key, sealed)
    pairs = [(hit, _signal_event(signal_id, hit.trigger_id, key, fired)) for hit in hits]
    return waits.apply(session, cipher, pairs, f"signal {signal_id} on {key}")


@dataclass(frozen=True)
class Outgoing:
    """A signal checked and sealed, ready to record: ``doc``, its payload's JSON, is what
    filters match (None: only unfiltered waits)."""

    key: str
    sealed: str
    doc: str | None = None
    sender: Sender | None = None


def outgoing(cipher: Cipher, key: str, payload: Any, sender: Sender | None = None) -> Outgoing:
    """``payload`` to ``key`` from ``sender``, checked and sealed (SignalError if the key or the
    payload is not one to send)."""
    data = _checked_json(payload)
    return Outgoing(
        check_signal_key(key), cipher.encrypt(Purpose.SIGNAL_PAYLOAD, data), data.decode(), sender
    )


@dataclass(frozen=True)
class Prelude:
    """A statement sent with the first statement that records signals, ahead of it (one round
    trip: ``pipelined``): one that takes their keys' locks. ``check`` reads its rows before
    anything is made of the signals' and may raise, for the caller to roll back."""

    statement: TextClause
    params: Mapping[str, Any]
    check: Callable[[Sequence[Any]], None] = lambda rows: None


def _chunks(outgoing: Sequence[Outgoing]) -> list[list[int]]:
    """The signals (their indexes) in statements, in order: a key at most once in each (a
    later signal on it finds its waiters as the earlier left them) and a sender's signals at
    most its ``kept`` (those beyond would be deleted before they are inserted)."""
    chunks: list[list[int]] = []
    keys: set[str] = set()
    by_sender: dict[str, int] = {}
    for n, signal in enumerate(outgoing):
        name = None if signal.sender is None else signal.sender.name
        full = (
            signal.sender is not None and by_sender.get(signal.sender.name, 0) >= signal.sender.kept
        )
        if not chunks or signal.key in keys or full:
            chunks.append([])
            keys, by_sender = set(), {}
        chunks[-1].append(n)
        keys.add(signal.key)
        if name is not None:
            by_sender[name] = by_sender.get(name, 0) + 1
    return chunks


def _send_params(chunk: Sequence[Outgoing]) -> dict[str, Any]:
    return {
        "keys": [o.key for o in chunk],
        "payloads": [o.sealed for o in chunk],
        "senders": [None if o.sender is None else o.sender.name for o in chunk],
        "kept": [1 if o.sender is None else o.sender.kept for o in chunk],
        "docs": [o.doc for o in chunk],
        "retention": SIGNAL_RETENTION,
        "prune": PRUNE_PER_SEND * len(chunk),
        "all_of": ALL_OF,
        "stripes": COUNT_STRIPES,
    }


# The order in which a signal's moves are listed: resumed, then all-of branches, then cancels.
def _phase(hit: waits.Hit) -> int:
    return 2 if hit.cancels is not None else int(hit.all_of and bool(hit.branch))


def _recorded(
    session: Session, cipher: Cipher, chunk: Sequence[Outgoing], rows: Sequence[Any]
) -> list[SentSignal]:
    """Resume (or cancel) what the chunk's signals (their rows of _SEND_SQL) matched, in one
    resume for them all."""
    by_key = {row.key: row for row in rows}
    fired: list[tuple[waits.Hit, transitions.FiredEvent, str]] = []
    owners: list[int] = []
    for n, signal in enumerate(chunk):
        row = by_key[signal.key]
        hits = [
            waits.Hit(trigger_id, branch, cancels, bool(all_of))
            for trigger_id, branch, cancels, all_of in zip(
                row.trigger_ids,
                row.branches or (),
                row.cancels or (),
                row.all_of or (),
                strict=True,
            )
        ]
        if not hits:
            continue
        event = _fired(cipher, signal.key, signal.sealed)
        for hit in sorted(hits, key=_phase):
            fired.append(
                (
                    hit,
                    _signal_event(row.id, hit.trigger_id, signal.key, event),
                    f"signal {row.id} on {signal.key}",
                )
            )
            owners.append(n)
    moved: list[list[int]] = [[] for _ in chunk]
    for n, ids in zip(
        owners, waits.apply_each(session, cipher, fired, shared_locked=True), strict=True
    ):
        moved[n] += ids
    return [
        SentSignal(by_key[s.key].id, s.key, tuple(m)) for s, m in zip(chunk, moved, strict=True)
    ]


def send_many_in(
    session: Session,
    cipher: Cipher,
    outgoing: Sequence[Outgoing],
    prelude: Prelude | None = None,
) -> list[SentSignal]:
    """Record the signals, in order, and resume every task waiting on each, in ``session``'s
    transaction; their keys' locks are held, or taken by ``prelude``, run first (alone if no
    signal is given). A statement records many signals (``_chunks``), one resume follows it."""
    sent: list[SentSignal | None] = [None] * len(outgoing)
    chunks = _chunks(outgoing)
    if prelude is not None:
        first = chunks[0] if chunks else []
        statements = [(prelude.statement, prelude.params)]
        if first:
            statements.append((_SEND_SQL, _send_params([outgoing[n] for n in first])))
        results = pipelined(session, statements)
        prelude.check(results[0])
    for index, chunk_ids in enumerate(chunks):
        chunk = [outgoing[n] for n in chunk_ids]
        if index == 0 and prelude is not None:
            rows: Sequence[Any] = results[1]
        else:
            rows = session.execute(_SEND_SQL, _send_params(chunk)).all()
        for n, signal in zip(chunk_ids, _recorded(session, cipher, chunk, rows), strict=True):
            sent[n] = signal
    return [signal for signal in sent if signal is not None]


def _record(session: Session, cipher: Cipher, signal: Outgoing, *, lock: bool) -> SentSignal:
    """Record one signal (taking its key's lock first if ``lock``, in the same round trip)."""
    prelude = Prelude(waits.LOCK_SQL, {"keys": [signal.key]}) if lock else None
    return send_many_in(session, cipher, [signal], prelude)[0]


def send_in(
    session: Session,
    cipher: Cipher,
    key: str,
    payload: Any,
    sender: Sender | None = None,
    idempotency_key: str | None = None,
    *,
    key_locked: bool = False,
) -> SentSignal:
    """Record a signal on ``key`` and resume every task waiting on it, in ``session``'s
    transaction (the key's lock is held until it ends); ``sender``: a web user, whose quota of
    kept signals applies. Under ``idempotency_key``, a repeat (same key, payload and sender)
    within the window records nothing and returns the first send's signal, ``replayed``;
    IdempotencyConflict for the key used with another send. ``key_locked``: the transaction
    already holds the key's lock (``waits.lock_keys``, taken for several sends at once)."""
    signal = outgoing(cipher, key, payload, sender)
    made = _idempotent(
        idempotency.SIGNALS if sender is None else f"{idempotency.SIGNALS}/{sender.name}",
        idempotency_key,
        lambda: {"key": key, "payload": serialization.to_jsonable(payload)},
    )

    def act() -> dict[str, Any]:
        return _record(session, cipher, signal, lock=not key_locked).answer()

    return SentSignal.from_outcome(idempotency.once(session, cipher, made, act))


def _idempotent(scope: str, key: str | None, body: Callable[[], Any]) -> idempotency.Request | None:
    try:
        return idempotency.request(scope, key, body)
    except idempotency.IdempotencyError as exc:
        raise SignalError(str(exc)) from None


_USED_SQL = text("SELECT EXISTS (SELECT FROM signal WHERE key = :key)")
_TRY_SQL = text("SELECT state, try_number FROM task_instance WHERE id = :id")


def answer_callback(
    session: Session,
    cipher: Cipher,
    claim: Claim,
    status: str,
    payload: Any,
    idempotency_key: str | None = None,
) -> SentSignal:
    """Answer the callback of a verified token: resume its task (``"success"``: with
    ``payload``; ``"failure"``: failing it with the payload's message), or, if it has not
    deferred yet, keep the answer for its wait. TokenRefused 409 for a token used before or a
    task cleared, finished or retried since; 400 for a bad status, payload or idempotency key.
    Under ``idempotency_key``, a repeat of the same answer within the window is answered as
    the first was (``replayed``) instead of refused as a second use of the token."""
    if status not in (SUCCESS, FAILURE):
        raise TokenRefused(400, f"status must be 'success' or 'failure', not {status!r:.40}")
    try:
        sealed = seal_payload(cipher, {"status": status, "payload": payload})
        made = _idempotent(
            f"{idempotency.CALLBACKS}/{claim.key}",
            idempotency_key,
            lambda: {"status": status, "payload": serialization.to_jsonable(payload)},
        )
    except SignalError as exc:
        raise TokenRefused(400, str(exc)) from None

    def act() -> dict[str, Any]:
        waits.lock_keys(session, [claim.key])
        if session.scalar(_USED_SQL, {"key": claim.key}):
            raise TokenRefused(409, "callback token already used")
        task = session.execute(_TRY_SQL, {"id": claim.task_instance_id}).one_or_none()
        if task is None or task.try_number != claim.try_number or task.state not in _ANSWERABLE:
            raise TokenRefused(
                409,
                "the task no longer waits for this callback (cleared, finished or retried since)",
            )
        return _record(session, cipher, Outgoing(claim.key, sealed), lock=False).answer()

    try:
        return SentSignal.from_outcome(idempotency.once(session, cipher, made, act))
    except IdempotencyConflict as exc:
        raise TokenRefused(409, str(exc)) from None


def failure_message(payload: Any) -> str:
    """The one line a failed callback fails its task with: the payload's ``message`` (or the
    payload itself), at most 1,000 characters."""
    said = payload.get("message", payload) if isinstance(payload, dict) else payload
    text_ = " ".join(str(said).split()) if said is not None else "callback reported failure"
    return f"callback reported failure: {text_[:1000]}"


def _row(
    classpath: str,
    kwargs: Mapping[str, Any],
    task_instance_id: int,
    try_number: int,
    branch: str = "",
) -> waits.WaitRow | None:
    """The row a signal, callback or asset event wait (its kwargs, values restored) is, or None
    for arguments that are not a valid SignalTrigger's, CallbackTrigger's or
    AssetEventTrigger's, or a token of another task or try (the triggerer fails those). A token
    kept from an earlier try would otherwise find that try's answer (kept for its wait) and
    resume this one with it. An asset event wait has no lookback: no signal is ever sent to its
    key, and an event recorded before the wait does not count."""
    if classpath == APPROVAL_TRIGGER:
        asks = InputRequest(
            kwargs.get("subject"),  # type: ignore[arg-type]
            kwargs.get("body"),
            tuple(kwargs.get("options") or ()),
            None,
            bool(kwargs.get("multiple")),
            {},
            None,
        )
        try:
            check_request(asks, "ApprovalTrigger")
        except (TypeError, ValueError):
            return None
        return waits.WaitRow(
            approval_key(task_instance_id), _NO_LOOKBACK, branch, asks=(try_number, asks)
        )
    if classpath == ASSET_TRIGGER:
        try:
            return waits.WaitRow(
                asset_key(check_asset_name(kwargs.get("asset"))), _NO_LOOKBACK, branch
            )
        except SignalError:
            return None
    if classpath == CALLBACK_TRIGGER:
        claim = parse_token(kwargs.get("token"))
        if claim is None or (claim.task_instance_id, claim.try_number) != (
            task_instance_id,
            try_number,
        ):
            return None
        try:
            heartbeat = check_heartbeat(kwargs.get("heartbeat"))
        except SignalError:
            return None
        # A callback may come before the deferral.
        return waits.WaitRow(claim.key, TOKEN_LIFETIME, branch, heartbeat=heartbeat)
    try:
        return waits.WaitRow(
            check_signal_key(kwargs.get("key")),
            check_lookback(kwargs.get("lookback")),
            branch,
            where_predicate(kwargs.get("where")),
        )
    except SignalError:
        return None


def wait_of(
    classpath: str,
    kwargs: Mapping[str, Any],
    task_instance_id: int,
    try_number: int,
    cancel_on: Mapping[str, Any] | None = None,
    cancel_state: str = "skipped",
) -> Wait | None:
    """What a deferral of try ``try_number`` of ``task_instance_id`` to ``classpath(**kwargs)``
    (serialization's JSON form), with ``cancel_on`` (a SignalTrigger's kwargs, checked when the
    task deferred), holds as rows: a signal or callback wait, the branches of a composite that
    need no running code and its timer, the cancel-on. None when nothing is (another trigger
    without cancel-on; a wait whose arguments are not valid, which the triggerer fails)."""
    try:
        plain = serialization.from_jsonable(dict(kwargs))
    except SerializationError:
        return None
    rows: list[waits.WaitRow] = []
    timer = None
    holds = True
    if classpath in COMPOSITES:
        for name, branch_classpath, branch_kwargs in plain.get(BRANCHES, ()):
            kind = branch_kind(branch_classpath, branch_kwargs)
            if kind in (SIGNAL, CALLBACK, ASSET, APPROVAL):
                row = _row(branch_classpath, branch_kwargs, task_instance_id, try_number, name)
                if row is None:
                    return None
                rows.append(row)
            holds = holds and kind != RUNNING
        timer = waits.timer_of(classpath, plain.get(BRANCHES, ()))
    elif classpath in (SIGNAL_TRIGGER, CALLBACK_TRIGGER, ASSET_TRIGGER, APPROVAL_TRIGGER):
        row = _row(classpath, plain, task_instance_id, try_number)
        if row is None:
            return None
        rows.append(row)
    else:
        holds = False
    if cancel_on is not None:
        cancel = _row(SIGNAL_TRIGGER, serialization.from_jsonable(dict(cancel_on)), 0, 0)
        if cancel is not None:
            rows.append(
                dataclasses.replace(cancel, branch=waits.CANCEL_BRANCH, cancels=cancel_state)
            )
    if not rows and timer is None:
        return None
    return Wait(tuple(rows), timer, holds, classpath == ALL_OF)


def register_waits(session: Session, cipher: Cipher, waits_: Mapping[int, Wait]) -> tuple[int, ...]:
    """Record the waits (trigger id -> wait) of tasks just deferred in ``session``'s
    transaction, whose keys :func:`waits.lock_keys` locked; resume (or cancel) at once those whose
    lookback holds a signal (that matches their filter). Returns the task instances moved."""
    waits.register_timers(session, waits_)
    rows = [(i, row, waits_[i].holds) for i in waits_ for row in waits_[i].rows]
    for _, row, _ in rows:
        if row.asks is not None:
            ti_id = int(row.key.removeprefix(APPROVAL_KEY_PREFIX))
            record_request(session, ti_id, row.asks[0], row.asks[1])
    if not rows:
        return ()
    matches = session.execute(
        _WAIT_SQL,
        {
            "trigger_ids": [i for i, _, _ in rows],
            "keys": [r.key for _, r, _ in rows],
            "branches": [r.branch for _, r, _ in rows],
            "matches": [r.match for _, r, _ in rows],
            "cancels": [r.cancels for _, r, _ in rows],
            "holds": [h for _, _, h in rows],
            "lookbacks": [r.lookback for _, r, _ in rows],
            "scan": LOOKBACK_SCAN,
        },
    ).all()
    found: dict[tuple[int, str], list[Any]] = {}
    for m in matches:
        found.setdefault((m.trigger_id, m.branch), []).append(m)
    by_place = {(i, r.branch): r for i, r, _ in rows}
    moved: list[int] = []
    for (trigger_id, branch), candidates in found.items():
        row = by_place[(trigger_id, branch)]
        signal = (
            candidates[0] if row.match is None else _first_match(session, cipher, row, candidates)
        )
        if signal is None:
            continue
        hit = waits.Hit(trigger_id, branch, row.cancels, waits_[trigger_id].all_of)
        moved += _apply(session, cipher, signal.id, row.key, signal.payload, [hit])
    return tuple(moved)


def _first_match(
    session: Session, cipher: Cipher, row: waits.WaitRow, candidates: Sequence[Any]
) -> Any:
    """Of the signals (newest first), the first whose payload matches ``row``'s filter,
    evaluated by PostgreSQL as a send's is; None if none does."""
    docs = [cipher.decrypt(Purpose.SIGNAL_PAYLOAD, c.payload).decode() for c in candidates]
    n = session.scalar(_FIRST_MATCH_SQL, {"docs": docs, "match": row.match})
    return None if n is None else candidates[n - 1]


def defer_with_waits(
    session: Session,
    cipher: Cipher,
    deferrals: Sequence[transitions.Deferral],
    waits_: Mapping[int, Wait],
    joined: set[int] | None = None,
) -> dict[int, int]:
    """``transitions.defer_many`` (``joined`` as there) for a batch of which some (task instance
    id -> wait) hold rows: their keys locked first (a send takes the same lock, then the
    waiters' rows), then their rows recorded and matched against the lookback. Returns task
    instance id -> trigger id for those that moved."""
    waits.lock_keys(session, [row.key for wait in waits_.values() for row in wait.rows])
    moved = transitions.defer_many(session, deferrals, joined)
    register_waits(session, cipher, {moved[t]: wait for t, wait in waits_.items() if t in moved})
    return moved


def not_a_wait(trigger_id: ColumnExpressionArgument[int | None]) -> ColumnElement[bool]:
    """True for a deferred task's ``trigger_id`` that no rows hold (a signal wait, a composite
    without a running branch): a trigger that must be in a stream (the reconciler's and the
    doctor's check). A cancel-on or a composite's rows beside a running trigger do not hold it."""
    held_by_row = (
        select(SignalWait.trigger_id)
        .where(SignalWait.trigger_id == trigger_id, SignalWait.holds)
        .exists()
    )
    held_by_timer = (
        select(WaitTimer.trigger_id)
        .where(WaitTimer.trigger_id == trigger_id, WaitTimer.holds)
        .exists()
    )
    return ~held_by_row & ~held_by_timer


def send(key: str, payload: Any = None, *, idempotency_key: str | None = None) -> SentSignal:
    """Send a signal to ``key`` (from task code, a script or a service), using the database
    and keys of ``DEFERRAL_DATABASE_URL`` and ``DEFERRAL_FERNET_KEY``. The tasks it resumes
    are queued by the scheduler's next pass. With ``idempotency_key``, a repeat of the same
    send within ``DEFERRAL_IDEMPOTENCY_WINDOW_SEC`` sends nothing and returns the first send's
    signal (``replayed``); the key reused for another send raises IdempotencyConflict."""
    store = metastore()
    with store.sessions.begin() as session:
        return send_in(session, store.cipher, key, payload, idempotency_key=idempotency_key)


@dataclass(frozen=True)
class KeyActivity:
    """What ``deferral signals list`` shows of a key: its recent signals and waiting tasks."""

    key: str
    signals: int  # signals kept (younger than SIGNAL_RETENTION)
    last_signal_id: int | None
    last_sent_at: dt.datetime | None
    waiting: tuple[str, ...]  # dag.run.task[map_index] of each task waiting on the key


_ACTIVITY_SQL = text(
    """
    WITH sent AS (
        SELECT key, count(*) AS signals, max(id) AS last_id, max(sent_at) AS last_at
        FROM signal WHERE CAST(:key AS text) IS NULL OR key = :key GROUP BY key
    ), waiting AS (
        SELECT w.key, array_agg(
            ti.dag_id || '.' || ti.run_id || '.' || ti.task_id
            || CASE WHEN ti.map_index >= 0 THEN '[' || ti.map_index || ']' ELSE '' END
            ORDER BY ti.id
        ) AS tasks
        FROM signal_wait AS w JOIN task_instance AS ti ON ti.trigger_id = w.trigger_id
        WHERE ti.state = 'deferred' AND w.cancels IS NULL
            AND w.key NOT LIKE 'asset/%' AND w.key NOT LIKE 'approval/%'
            AND (CAST(:key AS text) IS NULL OR w.key = :key)
        GROUP BY w.key
    )
    SELECT coalesce(sent.key, waiting.key) AS key, coalesce(sent.signals, 0) AS signals,
           sent.last_id, sent.last_at, coalesce(waiting.tasks, '{}') AS tasks
    FROM sent FULL JOIN waiting ON waiting.key = sent.key
    ORDER BY sent.last_at DESC NULLS LAST, key
    LIMIT :limit
    """
)


def activity(session: Session, key: str | None = None, limit: int = 100) -> list[KeyActivity]:
    """The keys with signals kept or tasks waiting (``key`` alone if given), the most recently
    signalled first."""
    if key is not None:
        check_signal_key(key)
    rows = session.execute(_ACTIVITY_SQL, {"key": key, "limit": limit})
    return [KeyActivity(r.key, r.signals, r.last_id, r.last_at, tuple(r.tasks)) for r in rows]


def heartbeat(session: Session, claim: Claim) -> dt.datetime:
    """A heartbeat posted to the callback of a verified token: the new deadline of its wait.
    TokenRefused 409 when no wait of the token beats now (no ``heartbeat`` set, answered,
    cleared, finished, retried since, or its deadline already passed)."""
    due = waits.beat(session, claim.key)
    if due is None:
        raise TokenRefused(
            409,
            "no heartbeat is awaited for this callback (no heartbeat set, answered, cleared,"
            " finished, retried since, or the heartbeat was already missed)",
        )
    return due
