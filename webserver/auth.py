"""Who is asking: logins, signed session cookies and CSRF tokens.

Reading pages needs a login unless the server listens on a loopback address only; acting
(trigger, pause, clear, mark) always does. A browser session is a cookie signed with a key
derived from the first Fernet key (rotating the key ends every session); it holds the user name,
a keyed fingerprint of the user's password as it was at login (a changed password or a deleted
user ends the session) and the CSRF token that every form and every API write made with the
cookie must carry. API clients may instead send HTTP Basic credentials with each request.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import ipaddress
import secrets
from collections.abc import Mapping

from sqlalchemy.orm import Session, sessionmaker
from starlette.requests import Request

from deferral import users
from deferral.config import Settings

SESSION_COOKIE = "deferral_session"
SESSION_MAX_AGE_SEC = 12 * 3600
CSRF_FIELD = "csrf_token"
CSRF_HEADER = "x-csrf-token"
_SESSION_CONTEXT = b"deferral webserver session v1"


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


class Auth:
    def __init__(
        self,
        sessions: sessionmaker[Session],
        key: bytes,
        *,
        open_reads: bool,
        environ: Mapping[str, str] | None = None,
    ) -> None:
        self._sessions = sessions
        self._key = key
        # Reading pages without a login: only when nobody but this machine can connect.
        self.open_reads = open_reads
        self._environ = environ

    def _fingerprint(self, identity: users.Identity) -> str:
        message = f"{identity.username}\0{identity.credential}".encode()
        return hmac.new(self._key, message, hashlib.sha256).hexdigest()

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
        """The user this request's session cookie is logged in as, if it still holds: the user
        exists and has the password they logged in with."""
        if "checked_user" in request.scope:
            checked: str | None = request.scope["checked_user"]
            return checked
        username = request.session.get("user")
        found = None
        if isinstance(username, str):
            with self._sessions() as session:
                identity = users.current_identity(session, username, self._environ)
            fingerprint = request.session.get("fingerprint")
            if (
                identity is not None
                and isinstance(fingerprint, str)
                and hmac.compare_digest(fingerprint, self._fingerprint(identity))
            ):
                found = username
            else:
                request.session.pop("user", None)
                request.session.pop("fingerprint", None)
        request.scope["checked_user"] = found
        return found

    def log_in(self, request: Request, username: str, password: str) -> bool:
        """Check the credentials; on success the session is renewed for that user (a new CSRF
        token too)."""
        with self._sessions.begin() as session:
            identity = users.authenticate(session, username, password, self._environ)
        if identity is None:
            return False
        request.session.clear()
        request.session.update(
            {
                "user": identity.username,
                "fingerprint": self._fingerprint(identity),
                CSRF_FIELD: secrets.token_urlsafe(32),
            }
        )
        request.scope["checked_user"] = identity.username
        return True

    def log_out(self, request: Request) -> None:
        request.session.clear()
        request.scope["checked_user"] = None

    # -- API clients -------------------------------------------------------------------------

    def basic_user(self, request: Request) -> str | None:
        """The user HTTP Basic credentials name, if they are right; None without any."""
        header = request.headers.get("authorization", "")
        scheme, _, encoded = header.partition(" ")
        if scheme.lower() != "basic" or not encoded:
            return None
        try:
            username, _, password = base64.b64decode(encoded, validate=True).decode().partition(":")
        except (binascii.Error, UnicodeDecodeError):
            return None
        with self._sessions.begin() as session:
            identity = users.authenticate(session, username, password, self._environ)
        return identity.username if identity is not None else None
