"""Fernet encryption of trigger kwargs, resume kwargs and stream tokens.

``DEFERRAL_FERNET_KEY`` holds one or more comma-separated keys: the first encrypts, all decrypt,
so a key can be rotated without losing what the old key sealed.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
from collections.abc import Sequence
from typing import Any

from cryptography.fernet import Fernet, InvalidToken, MultiFernet

from deferral.runtime import serialization


class DecryptionError(ValueError):
    """A token was forged, corrupted, or sealed with a key we no longer hold."""


# Stream entries that carry no secret are signed rather than encrypted, with a key derived from
# each Fernet key: the Fernet keys stay the one secret to configure and rotate.
_MAC_CONTEXT = b"deferral stream entry mac v1"


def _mac_key(fernet_key: str) -> bytes:
    return hmac.new(base64.urlsafe_b64decode(fernet_key), _MAC_CONTEXT, hashlib.sha256).digest()


class Cipher:
    def __init__(self, keys: Sequence[str]) -> None:
        self._fernet = MultiFernet([Fernet(key) for key in keys])
        self._mac_keys = [_mac_key(key) for key in keys]

    def sign(self, data: bytes) -> str:
        """An authentication code for ``data`` under the first key (base64url, no padding)."""
        digest = hmac.new(self._mac_keys[0], data, hashlib.sha256).digest()
        return base64.urlsafe_b64encode(digest).rstrip(b"=").decode("ascii")

    def keyed_digest(self, data: bytes, context: bytes) -> str:
        """A digest of ``data`` under a key derived from the first key for ``context`` (a
        different key per use: it never equals a stream entry's ``sign``); base64url, 43 chars.
        Equal data gives equal digests, and without the key nobody can confirm a guess of it."""
        key = hmac.new(self._mac_keys[0], context, hashlib.sha256).digest()
        digest = hmac.new(key, data, hashlib.sha256).digest()
        return base64.urlsafe_b64encode(digest).rstrip(b"=").decode("ascii")

    def verify(self, data: bytes, mac: str) -> bool:
        """Whether ``mac`` authenticates ``data`` under any of the keys (rotation)."""
        for key in self._mac_keys:
            digest = hmac.new(key, data, hashlib.sha256).digest()
            expected = base64.urlsafe_b64encode(digest).rstrip(b"=").decode("ascii")
            if hmac.compare_digest(expected, mac):
                return True
        return False

    def encrypt(self, plaintext: bytes) -> str:
        return self._fernet.encrypt(plaintext).decode("ascii")

    def decrypt(self, token: str | bytes) -> bytes:
        try:
            raw = token.encode("ascii") if isinstance(token, str) else token
            return self._fernet.decrypt(raw)
        except (InvalidToken, ValueError, TypeError):
            raise DecryptionError(
                "token failed authentication (forged, corrupted or unknown key)"
            ) from None

    def seal(self, value: Any, where: str = "value") -> str:
        """Serialize then encrypt."""
        return self.encrypt(serialization.dumps(value, where))

    def open(self, token: str | bytes) -> Any:
        """Decrypt then deserialize."""
        return serialization.loads(self.decrypt(token))

    def rotate(self, token: str) -> str:
        """Re-encrypt with the first key; DecryptionError if no key opens the token."""
        try:
            return self._fernet.rotate(token.encode("ascii")).decode("ascii")
        except (InvalidToken, ValueError, TypeError):
            raise DecryptionError(
                "token failed authentication (forged, corrupted or unknown key)"
            ) from None
