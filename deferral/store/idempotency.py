"""Idempotency keys: a request made under a key acts once; a repeat within the window
(``DEFERRAL_IDEMPOTENCY_WINDOW_SEC``) returns the first request's answer and does nothing more,
and a repeat of the key with another request is refused (:class:`IdempotencyConflict`), as
Stripe's API does.

The key is claimed by a row in the request's own transaction, ``INSERT ... ON CONFLICT DO
NOTHING`` on the ``(scope, key)`` primary key, never by a check and then an act: a concurrent
repeat's insert waits on the unique index until the first request's transaction ends. If that
committed, the repeat reads the row and its answer (written in the same transaction as the act);
if it rolled back (the request failed), the repeat claims the key and acts itself. Every claim
deletes a bounded number of expired keys, its own first.
"""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sqlalchemy import text
from sqlalchemy.orm import Session

from deferral.runtime.config import idempotency_window
from deferral.runtime.crypto import Cipher, Purpose

# Stripe's bound: room for a UUID, a hash, or a sender's own composite key.
MAX_KEY_LENGTH = 255
# The scopes of the kinds of request (a sender's name is added to those sent through the API).
SIGNALS, CALLBACKS, RUNS = "signals", "callbacks", "runs"
# Expired keys each claim deletes at most (besides its own): they go at least as fast as keys
# come.
SWEEP_PER_CLAIM = 100
# A conflicting row can vanish between the insert and the read (it expired and was swept): the
# claim is tried again, this many times at most.
_CLAIM_ATTEMPTS = 3

_SWEEP_SQL = text(
    """
    WITH expired AS (
        SELECT scope, key FROM idempotency_key WHERE created_at < now() - :window
        ORDER BY created_at LIMIT :limit FOR UPDATE SKIP LOCKED
    )
    DELETE FROM idempotency_key AS i
    WHERE i.created_at < now() - :window
      AND ((i.scope = :scope AND i.key = :key) OR (i.scope, i.key) IN (SELECT * FROM expired))
    """
)
_CLAIM_SQL = text(
    "INSERT INTO idempotency_key (scope, key, fingerprint) VALUES (:scope, :key, :fingerprint)"
    " ON CONFLICT (scope, key) DO NOTHING RETURNING true"
)
_FIRST_SQL = text(
    "SELECT fingerprint, answer FROM idempotency_key WHERE scope = :scope AND key = :key"
)
_ANSWER_SQL = text(
    "UPDATE idempotency_key SET answer = CAST(:answer AS jsonb) WHERE scope = :scope AND key = :key"
)


class IdempotencyError(ValueError):
    """An idempotency key that cannot be used; the message says why."""


class IdempotencyConflict(Exception):
    """The key was used within the window for another request; the message names the key."""


def check_key(key: object) -> str:
    """``key`` if it is 1 to MAX_KEY_LENGTH printable ASCII characters; else
    IdempotencyError."""
    if not isinstance(key, str) or not key:
        raise IdempotencyError("the idempotency key is empty: give 1-255 printable characters")
    if len(key) > MAX_KEY_LENGTH:
        raise IdempotencyError(
            f"the idempotency key is {len(key)} characters long, more than {MAX_KEY_LENGTH}"
        )
    if not (key.isascii() and key.isprintable()):
        raise IdempotencyError(
            f"the idempotency key {key[:40]!r} holds a character other than printable ASCII"
        )
    return key


@dataclass(frozen=True)
class Request:
    """A request made under an idempotency key: ``scope`` is what the key is unique within
    (the kind of request and who makes it), ``body`` what the request asks (JSON-able: two
    requests under one key are the same request when their bodies are equal)."""

    scope: str
    key: str
    body: Any

    def signed(self) -> bytes:
        return json.dumps(
            [self.scope, self.key, self.body], sort_keys=True, separators=(",", ":"), default=str
        ).encode()


def request(scope: str, key: str | None, body: Callable[[], Any]) -> Request | None:
    """The request under ``key`` (checked), its body what ``body()`` gives; None without a
    key."""
    return None if key is None else Request(scope, check_key(key), body())


@dataclass(frozen=True)
class Outcome:
    """What a request answered: the first request's answer when ``replayed``."""

    answer: dict[str, Any]
    replayed: bool = False


def once(
    session: Session,
    cipher: Cipher | None,
    made: Request | None,
    act: Callable[[], dict[str, Any]],
    window: dt.timedelta | None = None,
) -> Outcome:
    """``act()`` in ``session``'s transaction, unless ``made``'s key was claimed within the
    window: then the first request's answer (IdempotencyConflict if that request was another).
    Without a request, ``act()`` alone (and no cipher is needed)."""
    if made is None:
        return Outcome(act())
    assert cipher is not None, "an idempotent request's fingerprint is signed"
    where = {"scope": made.scope, "key": made.key}
    window = idempotency_window() if window is None else window
    session.execute(_SWEEP_SQL, {**where, "window": window, "limit": SWEEP_PER_CLAIM})
    for _ in range(_CLAIM_ATTEMPTS):
        fingerprint = cipher.sign(Purpose.IDEMPOTENT_REQUEST, made.signed())
        if session.scalar(_CLAIM_SQL, {**where, "fingerprint": fingerprint}):
            answer = act()
            session.execute(_ANSWER_SQL, {**where, "answer": json.dumps(answer)})
            return Outcome(answer)
        first = session.execute(_FIRST_SQL, where).one_or_none()
        if first is None:
            continue
        if not cipher.verify(Purpose.IDEMPOTENT_REQUEST, made.signed(), first.fingerprint):
            raise IdempotencyConflict(
                f"idempotency key {made.key[:80]!r} was used for another request within"
                f" {_shown(window)}: use a new key for a new request"
            )
        return Outcome(first.answer, replayed=True)
    raise IdempotencyConflict(f"idempotency key {made.key[:80]!r} is being claimed: try again")


def _shown(window: dt.timedelta) -> str:
    seconds = window.total_seconds()
    if seconds % 3600 == 0:
        return f"{seconds / 3600:g} h"
    return f"{seconds:g} s"
