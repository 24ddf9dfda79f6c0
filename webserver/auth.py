"""Who is asking: logins, server-side sessions, CSRF tokens, and the cost of a password guess.

Reading pages needs a login unless the server listens on a loopback address only; acting
(trigger, pause, clear, mark) always does. A browser session is a cookie signed with a key
derived from the first Fernet key (rotating the key ends every session); it holds a random token
whose digest names a ``web_session`` row (logging out deletes the row: every copy of the cookie
ends; the row's expiry is set at login and never extended), the user name, a keyed fingerprint
of the user's password as it was at login (a changed password or a deleted user ends the
session) and the CSRF token that every form and every API write made with the cookie must
carry. API clients may instead send HTTP Basic credentials with each request, and machines an
API token (``webserver.tokens``: ``Authorization: Bearer``), checked by one HMAC against its row,
read on every request; a signal's token is remembered once verified, and the transaction that
records the signal finds its row still there (``tokens.checked_and_locking``) instead.

Every password check, login form or Basic credentials, goes through ``Auth.verify``: throttled
per client and per user name (``webserver.throttle``), at most ARGON2_CONCURRENCY argon2
verifications at once (each takes 64 MiB and a core), run off the event loop, and a failure
logged with the user name cut and escaped. A right Basic password is remembered for
BASIC_CACHE_SEC, keyed by the credentials and checked against the user's current password
hash, so an API client does not pay argon2 on every request.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import datetime as dt
import hashlib
import hmac
import ipaddress
import logging
import os
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from sqlalchemy import delete, func, select
from sqlalchemy.orm import Session, sessionmaker
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request

from deferral.runtime.config import Settings
from deferral.runtime.crypto import Cipher
from deferral.store.tables import WebSession
from webserver import tokens, users
from webserver.inputs import loggable_name
from webserver.throttle import LoginThrottle

log = logging.getLogger("deferral.webserver")

SESSION_COOKIE = "deferral_session"
CSRF_FIELD = "csrf_token"
CSRF_HEADER = "x-csrf-token"
_SESSION_CONTEXT = b"deferral webserver session v1"
# argon2 verifications running at once: one per core (more only queue for the CPU, holding
# 64 MiB each meanwhile).
ARGON2_CONCURRENCY = max(1, os.cpu_count() or 1)
# How long a right Basic password is remembered, and for how many credentials at most.
BASIC_CACHE_SEC = 60.0
BASIC_CACHE_ENTRIES = 1024
# Verified API tokens remembered for writes that check the token's row in their own
# transaction (``Auth.bearer(rechecked=True)``), at most this many.
TOKEN_CACHE_ENTRIES = 1024


def session_key(settings: Settings) -> bytes:
    """The key that signs session cookies, derived from the first Fernet key: one secret to
    configure, and never the Fernet key itself."""
    fernet_key = base64.urlsafe_b64decode(settings.fernet_keys[0])
    return hmac.new(fernet_key, _SESSION_CONTEXT, hashlib.sha256).digest()


def is_loopback(host: str) -> bool:
    """Whether listening on ``host`` accepts connections from this machine only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def client_of(request: Request) -> str:
    return request.client.host if request.client is not None else "unknown"


@dataclass(frozen=True)
class Verdict:
    """What a password check found: who (None: refused), and if the check was not even made
    because of earlier failures, how long until it may be tried again."""

    identity: users.Identity | None
    retry_after_sec: float = 0.0


def has_bearer(request: Request) -> bool:
    """Whether the request sends an API token (``Authorization: Bearer ...``)."""
    return request.headers.get("authorization", "").partition(" ")[0].lower() == "bearer"


@dataclass(frozen=True)
class _Remembered:
    username: str
    fingerprint: str
    until: float


class Auth:
    def __init__(
        self,
        sessions: sessionmaker[Session],
        key: bytes,
        cipher: Cipher,
        *,
        open_reads: bool,
        session_lifetime: dt.timedelta,
        environ: Mapping[str, str] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._sessions = sessions
        self._key = key
        self._cipher = cipher
        # Reading pages without a login: only when nobody but this machine can connect.
        self.open_reads = open_reads
        self._lifetime = session_lifetime
        self._environ = environ
        self.clock = clock
        self.throttle = LoginThrottle()
        self._verifying: tuple[asyncio.AbstractEventLoop, asyncio.Semaphore] | None = None
        self._basic_cache: OrderedDict[str, _Remembered] = OrderedDict()
        self._token_cache: OrderedDict[str, tokens.Bearer] = OrderedDict()

    def _fingerprint(self, identity: users.Identity) -> str:
        message = f"{identity.username}\0{identity.credential}".encode()
        return hmac.new(self._key, message, hashlib.sha256).hexdigest()

    # -- checking a password -------------------------------------------------------------------

    def _semaphore(self) -> asyncio.Semaphore:
        # Made in the loop that uses it (a test client runs a loop of its own per block).
        loop = asyncio.get_running_loop()
        if self._verifying is None or self._verifying[0] is not loop:
            self._verifying = (loop, asyncio.Semaphore(ARGON2_CONCURRENCY))
        return self._verifying[1]

    def _authenticate(self, username: str, password: str) -> users.Identity | None:
        with self._sessions.begin() as session:
            return users.authenticate(session, username, password, self._environ)

    async def verify(self, client: str, username: str, password: str, via: str) -> Verdict:
        """Check a password, unless ``client`` or ``username`` must wait after failures."""
        wait = self.throttle.wait_sec(client, username, self.clock())
        if wait <= 0:
            async with self._semaphore():
                # Failures may have come in while this waited its turn.
                wait = self.throttle.wait_sec(client, username, self.clock())
                identity = (
                    await run_in_threadpool(self._authenticate, username, password)
                    if wait <= 0
                    else None
                )
        if wait > 0:
            log.warning(
                "%s: refused a login as %s from %s unchecked: too many failures, %.0f s left",
                via,
                loggable_name(username),
                client,
                wait,
            )
            return Verdict(None, wait)
        if identity is None:
            self.throttle.failed(client, username, self.clock())
            log.warning("%s: refused a login as %s from %s", via, loggable_name(username), client)
            return Verdict(None)
        self.throttle.succeeded(username)
        return Verdict(identity)

    # -- sessions ----------------------------------------------------------------------------

    def csrf_token(self, request: Request) -> str:
        token = request.session.get(CSRF_FIELD)
        if not isinstance(token, str):
            token = secrets.token_urlsafe(32)
            request.session[CSRF_FIELD] = token
        return token

    def csrf_valid(self, request: Request, given: object) -> bool:
        expected = request.session.get(CSRF_FIELD)
        return (
            isinstance(given, str)
            and isinstance(expected, str)
            and hmac.compare_digest(given.encode(), expected.encode())
        )

    def session_user(self, request: Request) -> str | None:
        """The user this request's session cookie is logged in as, if it still holds: its
        server-side row exists and has not expired, the user exists and has the password they
        logged in with."""
        if "checked_user" in request.scope:
            checked: str | None = request.scope["checked_user"]
            return checked
        username, token = request.session.get("user"), request.session.get("sid")
        found = None
        if isinstance(username, str) and isinstance(token, str):
            with self._sessions.begin() as session:
                row_user = session.scalar(
                    select(WebSession.username).where(
                        WebSession.id == _digest(token), WebSession.expires_at > func.now()
                    )
                )
                identity = (
                    users.current_identity(session, username, self._environ)
                    if row_user == username
                    else None
                )
                fingerprint = request.session.get("fingerprint")
                if (
                    identity is not None
                    and isinstance(fingerprint, str)
                    and hmac.compare_digest(fingerprint, self._fingerprint(identity))
                ):
                    found = username
                else:
                    session.execute(delete(WebSession).where(WebSession.id == _digest(token)))
        if found is None:
            for name in ("user", "sid", "fingerprint"):
                request.session.pop(name, None)
        request.scope["checked_user"] = found
        return found

    def start_session(self, request: Request, identity: users.Identity) -> None:
        """Log ``identity`` in: a new server-side session (and a new CSRF token)."""
        token = secrets.token_urlsafe(32)
        with self._sessions.begin() as session:
            session.execute(delete(WebSession).where(WebSession.expires_at <= func.now()))
            session.add(
                WebSession(
                    id=_digest(token),
                    username=identity.username,
                    expires_at=func.now() + self._lifetime,
                )
            )
        request.session.clear()
        request.session.update(
            {
                "user": identity.username,
                "sid": token,
                "fingerprint": self._fingerprint(identity),
                CSRF_FIELD: secrets.token_urlsafe(32),
            }
        )
        request.scope["checked_user"] = identity.username

    def log_out(self, request: Request) -> None:
        """End this session everywhere: its row goes, so a copy of the cookie is no login."""
        token = request.session.get("sid")
        if isinstance(token, str):
            with self._sessions.begin() as session:
                session.execute(delete(WebSession).where(WebSession.id == _digest(token)))
        request.session.clear()
        request.scope["checked_user"] = None

    # -- API clients -------------------------------------------------------------------------

    def _token(self, token: str) -> tokens.Bearer | None:
        # One statement and no transaction around it (no BEGIN, no ROLLBACK): the row read
        # once, at the moment of the request.
        engine = self._sessions.kw["bind"]
        with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            return tokens.verify(conn, self._cipher, token)

    def _token_cache_key(self, request: Request) -> tuple[str, str]:
        """The token the request sends, and the keyed hash it is remembered by (the secret
        itself is never a key)."""
        token = request.headers.get("authorization", "").partition(" ")[2].strip()
        return token, hmac.new(self._key, f"token\0{token}".encode(), hashlib.sha256).hexdigest()

    async def bearer(self, request: Request, *, rechecked: bool = False) -> tokens.Bearer | None:
        """The API token the request sends (``has_bearer``), if it is a valid one: its row read
        now, or with ``rechecked`` (the caller's write transaction refuses the token if its
        row is gone: ``tokens.checked_and_locking``) as verified by an earlier request."""
        token, cache_key = self._token_cache_key(request)
        if rechecked:
            remembered = self._token_cache.get(cache_key)
            if remembered is not None:
                return remembered
        bearer = await run_in_threadpool(self._token, token)
        if rechecked and bearer is not None:
            self._token_cache[cache_key] = bearer
            while len(self._token_cache) > TOKEN_CACHE_ENTRIES:
                self._token_cache.popitem(last=False)
        return bearer

    def forget_bearer(self, request: Request) -> None:
        """Forget the request's token: its transaction found it revoked."""
        self._token_cache.pop(self._token_cache_key(request)[1], None)

    def _current_fingerprint(self, username: str) -> str | None:
        with self._sessions() as session:
            identity = users.current_identity(session, username, self._environ)
        return None if identity is None else self._fingerprint(identity)

    async def basic_user(self, request: Request) -> Verdict | None:
        """What HTTP Basic credentials are worth; None without any (or unreadable ones)."""
        header = request.headers.get("authorization", "")
        scheme, _, encoded = header.partition(" ")
        if scheme.lower() != "basic" or not encoded:
            return None
        try:
            username, _, password = base64.b64decode(encoded, validate=True).decode().partition(":")
        except (binascii.Error, UnicodeDecodeError):
            return None
        cache_key = hmac.new(
            self._key, f"basic\0{username}\0{password}".encode(), hashlib.sha256
        ).hexdigest()
        remembered = self._basic_cache.get(cache_key)
        if remembered is not None and remembered.until > self.clock():
            # Still right only while the user has the password it was right for.
            current = await run_in_threadpool(self._current_fingerprint, remembered.username)
            if current is not None and hmac.compare_digest(current, remembered.fingerprint):
                return Verdict(users.Identity(remembered.username, ""))
        self._basic_cache.pop(cache_key, None)
        verdict = await self.verify(client_of(request), username, password, "basic auth")
        if verdict.identity is not None:
            self._basic_cache[cache_key] = _Remembered(
                verdict.identity.username,
                self._fingerprint(verdict.identity),
                self.clock() + BASIC_CACHE_SEC,
            )
            while len(self._basic_cache) > BASIC_CACHE_ENTRIES:
                self._basic_cache.popitem(last=False)
        return verdict
