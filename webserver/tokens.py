"""API tokens for machines: named, scoped (``signals``, ``callbacks``, ``runs``), made and
revoked with ``deferral tokens``, sent as ``Authorization: Bearer <token>``.

A token is ``dfr_<id>_<secret>``, the secret 32 random bytes: too many to guess, so it is stored
as a keyed hash (an HMAC under ``Purpose.API_TOKEN``, a key derived from the Fernet keys) and
checked with one HMAC and a constant-time compare, not with a password hash (argon2 is for what
people choose). The id finds the row; a key rotation keeps tokens valid while the old key is
still configured. A request reads the row, or, for a signal (`webserver.signalbatch`), the
transaction that records it finds the row still there (``checked_and_locking``): either way a
revoked token (its row deleted; ids are never reused) is refused by the next request, in any
webserver replica, with no cache to outlive it.
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection, delete, select, text
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.orm import Session

from deferral import signals
from deferral.runtime.crypto import Cipher, Purpose
from deferral.store import waits
from deferral.store.tables import ApiToken

SIGNALS, CALLBACKS, RUNS = "signals", "callbacks", "runs"
SCOPES = (SIGNALS, CALLBACKS, RUNS)
PREFIX = "dfr_"
# Short enough that "token:<name>" fits where a web user's name is recorded (64 characters).
_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,50}$")
_TOKEN = re.compile(r"^dfr_([0-9]{1,18})_([A-Za-z0-9_\-]{43})$")
_ROW_SQL = text("SELECT name, scopes, digest FROM api_token WHERE id = :id")
# The tokens' rows that exist, and (the CTE) the signal keys' wait locks taken: one round trip
# at the start of a batch of signals.
_LIVE_SQL = text(
    f"WITH locked AS ({waits.LOCK_KEYS_QUERY})"
    " SELECT (SELECT count(*) FROM locked) AS locks,"
    " ARRAY(SELECT id FROM api_token WHERE id = ANY(CAST(:ids AS bigint[]))) AS live"
)


class TokenError(ValueError):
    """A token name or scope that cannot be used; the message says why."""


@dataclass(frozen=True)
class Bearer:
    """A verified token: its row's id, its name and what it may do."""

    id: int
    name: str
    scopes: tuple[str, ...]

    @property
    def acting(self) -> str:
        """Who the token acts as, where a web user's name is recorded (a user name has no
        ':', so none is mistaken for a token)."""
        return f"token:{self.name}"


def check_name(name: str) -> str:
    if not _NAME.match(name):
        raise TokenError(
            f"token name {name[:80]!r} is invalid: use 1-50 letters, digits, '_', '.' or '-'"
        )
    return name


def check_scopes(scopes: Iterable[str]) -> tuple[str, ...]:
    """The scopes, in SCOPES' order; TokenError for none or an unknown one."""
    given = set(scopes)
    for scope in sorted(given):
        if scope not in SCOPES:
            raise TokenError(f"unknown scope {scope[:40]!r}: use {', '.join(SCOPES)}")
    if not given:
        raise TokenError(f"give at least one --scope: {', '.join(SCOPES)}")
    return tuple(s for s in SCOPES if s in given)


def _digest(cipher: Cipher, secret: str) -> str:
    return cipher.sign(Purpose.API_TOKEN, secret.encode())


def create_token(session: Session, cipher: Cipher, name: str, scopes: Iterable[str]) -> str | None:
    """A new token named ``name`` with ``scopes``: its full text, to be shown once (None if the
    name is taken; nothing changes then)."""
    secret = secrets.token_urlsafe(32)
    statement = insert(ApiToken).values(
        name=check_name(name), scopes=list(check_scopes(scopes)), digest=_digest(cipher, secret)
    )
    made = session.execute(statement.on_conflict_do_nothing().returning(ApiToken.id)).scalar()
    return None if made is None else f"{PREFIX}{made}_{secret}"


def revoke_token(session: Session, name: str) -> bool:
    """Delete the token ``name``: every request with it is refused from the commit on; False
    if there is none of that name."""
    removed = session.execute(delete(ApiToken).where(ApiToken.name == name).returning(ApiToken.id))
    return removed.scalar() is not None


def token_list(session: Session) -> list[dict[str, Any]]:
    rows = session.execute(
        select(ApiToken.name, ApiToken.scopes, ApiToken.created_at).order_by(ApiToken.name)
    )
    return [{"name": r.name, "scopes": list(r.scopes), "created_at": r.created_at} for r in rows]


def verify(connection: Connection, cipher: Cipher, token: str) -> Bearer | None:
    """The token's name and scopes, if it is one that exists and its secret is right."""
    shape = _TOKEN.match(token)
    if shape is None:
        return None
    row = connection.execute(_ROW_SQL, {"id": int(shape[1])}).one_or_none()
    if row is None or not cipher.verify(Purpose.API_TOKEN, shape[2].encode(), row.digest):
        return None
    return Bearer(int(shape[1]), row.name, tuple(row.scopes))


class Revoked(Exception):
    """A token verified earlier whose row is gone: revoked since."""


class Gone(Exception):
    """Tokens (``ids``) of a batch found revoked by its first statement: the batch is rolled
    back and written again without their sends."""

    def __init__(self, ids: set[int]) -> None:
        super().__init__(f"tokens {sorted(ids)} revoked")
        self.ids = ids


def checked_and_locking(ids: Iterable[int], locking: Iterable[str]) -> signals.Prelude:
    """The first statement of a batch of signals: the wait locks of the signal keys
    ``locking`` taken (``waits.lock_keys``: held until the transaction ends) and the token ids'
    rows read, as the transaction sees them; Gone for those whose rows are gone (revoked)."""
    wanted = set(ids)

    def check(rows: Sequence[Any]) -> None:
        gone = wanted - set(rows[0].live)
        if gone:
            raise Gone(gone)

    return signals.Prelude(_LIVE_SQL, {"ids": sorted(wanted), "keys": sorted(set(locking))}, check)
