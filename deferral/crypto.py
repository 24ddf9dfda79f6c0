"""Fernet encryption of trigger kwargs, resume kwargs and stream tokens.

``DEFERRAL_FERNET_KEY`` holds one or more comma-separated keys: the first encrypts, all decrypt,
so a key can be rotated without losing what the old key sealed.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from cryptography.fernet import Fernet, InvalidToken, MultiFernet

from deferral import serialization


class DecryptionError(ValueError):
    """A token was forged, corrupted, or sealed with a key we no longer hold."""


class Cipher:
    def __init__(self, keys: Sequence[str]) -> None:
        self._fernet = MultiFernet([Fernet(key) for key in keys])

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
