"""Who may log in to the web UI: rows of the ``user`` table (argon2id hashes, made by
``deferral users create``) and, optionally, one ``admin`` whose password is the environment's
``DEFERRAL_WEBSERVER_ADMIN_PASSWORD``. A password is never stored, logged or shown.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field

import argon2
from argon2.exceptions import InvalidHashError, VerificationError
from sqlalchemy import delete, select
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.orm import Session

from deferral.runtime.config import secret
from deferral.store.tables import User, WebSession

ADMIN_PASSWORD_ENV = "DEFERRAL_WEBSERVER_ADMIN_PASSWORD"
# The user name the environment's password logs in as.
ENV_ADMIN = "admin"
MIN_PASSWORD_LENGTH = 8
_USERNAME = re.compile(r"^[A-Za-z0-9_.@\-]{1,64}$")

# argon2id with the library's (RFC 9106 low-memory) parameters.
_hasher = argon2.PasswordHasher()


@functools.cache
def _dummy_hash() -> str:
    """Verified when the user does not exist, so that a wrong name costs what a wrong password
    does (made on first use: hashing takes a while)."""
    return _hasher.hash("not a password of anyone")


class UserError(ValueError):
    """A user name or password that cannot be used; the message says why."""


def check_username(username: str) -> str:
    if not _USERNAME.match(username):
        raise UserError(
            f"user name {username!r} is invalid: use 1-64 letters, digits, '_', '.', '@' or '-'"
        )
    return username


def check_password(password: str) -> str:
    if len(password) < MIN_PASSWORD_LENGTH:
        raise UserError(f"the password must have at least {MIN_PASSWORD_LENGTH} characters")
    return password


def create_user(session: Session, username: str, password: str) -> bool:
    """Add a user; False if the name is taken (nothing changes then)."""
    statement = insert(User).values(
        username=check_username(username), password_hash=_hasher.hash(check_password(password))
    )
    created = session.execute(statement.on_conflict_do_nothing().returning(User.id))
    return created.scalar() is not None


def delete_user(session: Session, username: str) -> bool:
    """Remove a user, and end their web UI logins; False if there is none of that name."""
    removed = session.execute(delete(User).where(User.username == username).returning(User.id))
    session.execute(delete(WebSession).where(WebSession.username == username))
    return removed.scalar() is not None


def admin_password(environ: Mapping[str, str] | None = None) -> str | None:
    """The environment's admin password, or the file's that ``..._FILE`` names (unset or empty:
    none)."""
    return secret(os.environ if environ is None else environ, ADMIN_PASSWORD_ENV) or None


def _same_secret(given: str, expected: str) -> bool:
    # Digests first: compare_digest on the raw strings would reveal their length.
    digest = hashlib.sha256
    return hmac.compare_digest(digest(given.encode()).digest(), digest(expected.encode()).digest())


@dataclass(frozen=True)
class Identity:
    username: str
    # What the password is now (its stored hash, or the environment's password), for the web
    # UI to fingerprint with its key, so that a session made with an old password ends. Never
    # shown: not in repr.
    credential: str = field(repr=False)


def authenticate(
    session: Session, username: str, password: str, environ: Mapping[str, str] | None = None
) -> Identity | None:
    """Who logs in with these credentials, or None."""
    env_password = admin_password(environ)
    if username == ENV_ADMIN and env_password is not None:
        # The environment's admin shadows a stored user of that name.
        return Identity(ENV_ADMIN, env_password) if _same_secret(password, env_password) else None
    user = session.scalars(select(User).where(User.username == username)).one_or_none()
    try:
        _hasher.verify(user.password_hash if user is not None else _dummy_hash(), password)
    except (VerificationError, InvalidHashError):
        return None
    if user is None:
        return None
    if _hasher.check_needs_rehash(user.password_hash):
        user.password_hash = _hasher.hash(password)
    return Identity(user.username, user.password_hash)


def current_identity(
    session: Session, username: str, environ: Mapping[str, str] | None = None
) -> Identity | None:
    """The identity ``username`` has now (None: no longer a user), to check a session against."""
    env_password = admin_password(environ)
    if username == ENV_ADMIN and env_password is not None:
        return Identity(ENV_ADMIN, env_password)
    stored = session.scalars(select(User.password_hash).where(User.username == username)).first()
    return None if stored is None else Identity(username, stored)
