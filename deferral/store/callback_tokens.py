"""Callback tokens: ``context["callback"]`` gives a task a single-use, signed, expiring token
(and its URL); ``POST /api/v1/callbacks/{token}`` resumes the task that deferred on
``CallbackTrigger()`` with it. The token names the task instance, its try, its expiry and a
random nonce, signed with an HMAC keyed from the Fernet keys; it is the only credential.

Whoever holds a token can answer for the task, so it is never shown: every masker of every
process masks the token's shape (``secrets_masker.CALLBACK_TOKEN_SHAPE``), so a token in a
rendered field, a log line, an XCom or a page reads as ``***`` while the task itself gets the
real value. The answer is bound to the token's try: the wait of a later try, and the answer to a
try that has ended, refuse it."""

from __future__ import annotations

import datetime as dt
import secrets
from dataclasses import dataclass
from functools import cached_property

from deferral.runtime.config import callback_base_url
from deferral.runtime.crypto import Cipher, Purpose
from deferral.triggers.signal import SIGNAL_RETENTION

# A token lives no longer than a signal is kept: its use stays on record while it is valid,
# so a replay is always recognised.
TOKEN_LIFETIME = SIGNAL_RETENTION
MAX_TOKEN_LENGTH = 256
# Keys of callback waits: '/' is not allowed in a signal key, so no signal can reach them.
CALLBACK_KEY_PREFIX = "callback/"
_DOMAIN = b"deferral callback token v1\x00"


class TokenRefused(Exception):
    """A callback token or answer refused: ``status`` is the HTTP status, the message one
    line."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class Claim:
    """What a token says: the task instance and try it resumes, until when, and its nonce."""

    task_instance_id: int
    try_number: int
    expires_at: int  # seconds since the epoch
    nonce: str

    @property
    def key(self) -> str:
        return f"{CALLBACK_KEY_PREFIX}{self.task_instance_id}/{self.try_number}/{self.nonce}"


def _body(claim: Claim) -> str:
    return f"{claim.task_instance_id}.{claim.try_number}.{claim.expires_at}.{claim.nonce}"


def make_token(cipher: Cipher, task_instance_id: int, try_number: int, now: dt.datetime) -> str:
    claim = Claim(
        task_instance_id,
        try_number,
        int((now + TOKEN_LIFETIME).timestamp()),
        secrets.token_urlsafe(12),
    )
    body = _body(claim)
    return f"{body}.{cipher.sign(Purpose.CALLBACK_TOKEN, _DOMAIN + body.encode())}"


def parse_token(token: object) -> Claim | None:
    """What ``token`` claims, unverified (None if it is no token's shape)."""
    if not isinstance(token, str) or len(token) > MAX_TOKEN_LENGTH or not token.isascii():
        return None
    parts = token.split(".")
    if len(parts) != 5 or not all(p.isdigit() and len(p) <= 19 for p in parts[:3]):
        return None
    nonce = parts[3]
    if not nonce or not all(c.isalnum() or c in "-_" for c in nonce):
        return None
    return Claim(int(parts[0]), int(parts[1]), int(parts[2]), nonce)


def read_token(cipher: Cipher, token: str, now: dt.datetime) -> Claim:
    """The verified claim of ``token``; TokenRefused 404 if it is forged or no token, 410 if
    it expired. The signature is compared in constant time."""
    claim = parse_token(token)
    if claim is None or not cipher.verify(
        Purpose.CALLBACK_TOKEN, _DOMAIN + _body(claim).encode(), token.rsplit(".")[-1]
    ):
        raise TokenRefused(404, "unknown callback token")
    if claim.expires_at < now.timestamp():
        expired = dt.datetime.fromtimestamp(claim.expires_at, dt.UTC).isoformat()
        raise TokenRefused(410, f"callback token expired at {expired}")
    return claim


class CallbackHandle:
    """``context["callback"]``: the attempt's callback ``token`` and ``url``, made on first
    use (an attempt that never asks costs nothing)."""

    def __init__(self, task_instance_id: int, try_number: int) -> None:
        self.task_instance_id = task_instance_id
        self.try_number = try_number

    @cached_property
    def token(self) -> str:
        from deferral.store.metastore import metastore

        return make_token(
            metastore().cipher, self.task_instance_id, self.try_number, dt.datetime.now(dt.UTC)
        )

    @property
    def url(self) -> str:
        return f"{callback_base_url()}/api/v1/callbacks/{self.token}"

    def __repr__(self) -> str:
        return f"<callback of task instance {self.task_instance_id} try {self.try_number}>"
