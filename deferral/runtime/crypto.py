"""Fernet sealing and MACs, each bound to its purpose.

``DEFERRAL_FERNET_KEY`` holds one or more comma-separated keys: the first seals, all open, so a
key can be rotated without losing what the old key sealed. Nothing is sealed or signed with a
configured key itself: each :class:`Purpose` has its own key derived from each configured key
(HKDF, the purpose's name as the info), so a blob sealed for one purpose (a signal payload whose
plaintext a user chose) never opens as another (a trigger spec, a dead letter).
"""

from __future__ import annotations

import base64
import enum
import hashlib
import hmac
from collections.abc import Sequence
from typing import Any

from cryptography.fernet import Fernet, InvalidToken, MultiFernet
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from deferral.runtime import serialization


class DecryptionError(ValueError):
    """A token was forged, corrupted, sealed for another purpose, or sealed with a key we no
    longer hold."""


class Purpose(enum.Enum):
    """What a sealed blob or a MAC is for; its value is the derivation's info (never change
    one: what was sealed under it would no longer open)."""

    TRIGGER_SPEC = "trigger spec"  # a deferral:triggers entry's token
    TRIGGER_KWARGS = "trigger kwargs"  # trigger.kwargs
    RESUME_KWARGS = "resume kwargs"  # task_instance.next_kwargs
    EVENT = "event"  # an event's payload: deferral:events, task_instance.next_event
    CARRIED_LOG = "carried log"  # the log lines an event carries
    DEAD_LETTER = "dead letter"  # a dead letter's sealed entry, and the MAC of its clear fields
    SIGNAL_PAYLOAD = "signal payload"  # signal.payload
    WATCHER_SPEC = "watcher spec"  # asset_watcher.kwargs
    STORED_SECRET = "stored secret"  # variable.val, connection.password and .extra
    STREAM_ENTRY = "stream entry"  # the MAC of an events or queue entry
    CALLBACK_TOKEN = "callback token"  # the MAC of a callback token
    IDEMPOTENT_REQUEST = "idempotent request"  # idempotency_key.fingerprint
    API_TOKEN = "api token"  # api_token.digest, the keyed hash of a machine's token


# Sealed before purposes existed (with the configured keys themselves), and still opened as a
# fallback: the purposes whose blobs persist in PostgreSQL, which a reader of the database cannot
# replace, or travel under a MAC that covers them (events, carried logs). Never a purpose read
# from a Redis field nothing authenticates (trigger spec, dead letter): there an old blob whose
# plaintext a user chose (a signal payload sealed before the upgrade) would pass (deferral
# DECISIONS 83).
LEGACY_READABLE = frozenset(
    {
        Purpose.TRIGGER_KWARGS,
        Purpose.RESUME_KWARGS,
        Purpose.EVENT,
        Purpose.CARRIED_LOG,
        Purpose.SIGNAL_PAYLOAD,
        Purpose.WATCHER_SPEC,
        Purpose.STORED_SECRET,
    }
)

# The MACs of stream entries and callback tokens keep the key they had before purposes (tokens
# handed out and entries in flight stay valid across an upgrade); callback tokens are kept
# apart from entries by their domain prefix, and no MAC key is ever a sealing key.
_LEGACY_MAC = frozenset({Purpose.STREAM_ENTRY, Purpose.CALLBACK_TOKEN})
_MAC_CONTEXT = b"deferral stream entry mac v1"


def _derive(raw_key: bytes, info: bytes) -> bytes:
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=info).derive(raw_key)


def _b64(digest: bytes) -> str:
    return base64.urlsafe_b64encode(digest).rstrip(b"=").decode("ascii")


class Cipher:
    def __init__(self, keys: Sequence[str]) -> None:
        self._raw = [base64.urlsafe_b64decode(key) for key in keys]
        self._legacy = MultiFernet([Fernet(key) for key in keys])
        self._fernets: dict[Purpose, MultiFernet] = {}
        self._macs: dict[Purpose, list[bytes]] = {}

    # -- keys (derived on first use: a process uses a few purposes) ---------------------------

    def _fernet(self, purpose: Purpose) -> MultiFernet:
        fernet = self._fernets.get(purpose)
        if fernet is None:
            info = b"deferral seal/" + purpose.value.encode()
            derived = [base64.urlsafe_b64encode(_derive(raw, info)) for raw in self._raw]
            fernet = self._fernets[purpose] = MultiFernet([Fernet(k) for k in derived])
        return fernet

    def _mac_keys(self, purpose: Purpose) -> list[bytes]:
        keys = self._macs.get(purpose)
        if keys is None:
            if purpose in _LEGACY_MAC:
                keys = [hmac.new(raw, _MAC_CONTEXT, hashlib.sha256).digest() for raw in self._raw]
            else:
                info = b"deferral mac/" + purpose.value.encode()
                keys = [_derive(raw, info) for raw in self._raw]
            self._macs[purpose] = keys
        return keys

    # -- MACs ----------------------------------------------------------------------------------

    def sign(self, purpose: Purpose, data: bytes) -> str:
        """An authentication code for ``data`` under the first key (base64url, no padding)."""
        return _b64(hmac.new(self._mac_keys(purpose)[0], data, hashlib.sha256).digest())

    def verify(self, purpose: Purpose, data: bytes, mac: str) -> bool:
        """Whether ``mac`` authenticates ``data`` for ``purpose`` under any of the keys."""
        for key in self._mac_keys(purpose):
            expected = _b64(hmac.new(key, data, hashlib.sha256).digest())
            if hmac.compare_digest(expected, mac):
                return True
        return False

    def keyed_digest(self, data: bytes, context: bytes) -> str:
        """A digest of ``data`` under a key derived from the first key for ``context`` (a
        different key per use: it never equals a MAC); base64url, 43 chars. Equal data gives
        equal digests, and without the key nobody can confirm a guess of it."""
        first = self._mac_keys(Purpose.STREAM_ENTRY)[0]
        key = hmac.new(first, context, hashlib.sha256).digest()
        return _b64(hmac.new(key, data, hashlib.sha256).digest())

    # -- sealing -------------------------------------------------------------------------------

    def encrypt(self, purpose: Purpose, plaintext: bytes) -> str:
        return self._fernet(purpose).encrypt(plaintext).decode("ascii")

    def decrypt(self, purpose: Purpose, token: str | bytes) -> bytes:
        """The plaintext of a token sealed for ``purpose``; DecryptionError naming the purpose
        if none of the keys opens it as one."""
        try:
            raw = token.encode("ascii") if isinstance(token, str) else token
        except UnicodeEncodeError:
            raw = b""
        try:
            return self._fernet(purpose).decrypt(raw)
        except (InvalidToken, ValueError, TypeError):
            pass
        if purpose in LEGACY_READABLE:
            try:
                return self._legacy.decrypt(raw)
            except (InvalidToken, ValueError, TypeError):
                pass
        raise DecryptionError(
            f"token failed authentication as a {purpose.value} (forged, corrupted, sealed for"
            " another purpose or with an unknown key)"
        )

    def seal(self, purpose: Purpose, value: Any, where: str = "value") -> str:
        """Serialize then encrypt."""
        return self.encrypt(purpose, serialization.dumps(value, where))

    def open(self, purpose: Purpose, token: str | bytes) -> Any:
        """Decrypt then deserialize."""
        return serialization.loads(self.decrypt(purpose, token))

    def rotate(self, purpose: Purpose, token: str) -> str:
        """Sealed again with the first key's ``purpose`` key (also what was sealed before
        purposes, where that is still read); DecryptionError if no key opens the token."""
        return self.encrypt(purpose, self.decrypt(purpose, token))
