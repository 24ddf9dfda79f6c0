"""deferral.runtime.crypto: Fernet sealing with key rotation; every bad token is a
DecryptionError."""

from __future__ import annotations

import base64
import datetime as dt
from typing import Any

import pytest
from cryptography.fernet import Fernet

from deferral.runtime.crypto import Cipher, DecryptionError
from deferral.runtime.serialization import SerializationError

OLD = Fernet.generate_key().decode()
NEW = Fernet.generate_key().decode()
OTHER = Fernet.generate_key().decode()

MESSAGE = "token failed authentication (forged, corrupted or unknown key)"


@pytest.mark.parametrize(
    "value",
    [
        {"moment": dt.datetime(2024, 1, 1, tzinfo=dt.UTC), "pair": (1, 2), "n": None},
        [1, "two", 3.0],
        "secret",
        None,
        {"wait": dt.timedelta(days=-1, microseconds=5)},
    ],
)
def test_seal_open_round_trip(value: Any) -> None:
    cipher = Cipher([NEW])
    token = cipher.seal(value)
    assert isinstance(token, str)
    assert cipher.open(token) == value
    assert cipher.open(token.encode("ascii")) == value


def test_sealed_token_does_not_show_the_plaintext() -> None:
    cipher = Cipher([NEW])
    token = cipher.seal({"password": "hunter2-very-secret"})
    assert "hunter2" not in token
    assert b"hunter2" not in base64.urlsafe_b64decode(token)


def test_encrypt_decrypt_bytes() -> None:
    cipher = Cipher([NEW])
    assert cipher.decrypt(cipher.encrypt(b"\x00\xffabc")) == b"\x00\xffabc"


def test_seal_refuses_unserializable_value_naming_where() -> None:
    with pytest.raises(SerializationError) as info:
        Cipher([NEW]).seal({"conn": object()}, "next_kwargs")
    assert "next_kwargs['conn']" in str(info.value)
    assert "object" in str(info.value)


def test_rotation_old_token_opens_when_old_key_is_second() -> None:
    old_token = Cipher([OLD]).seal({"a": 1})
    rotated = Cipher([NEW, OLD])
    assert rotated.open(old_token) == {"a": 1}


def test_rotation_new_tokens_are_made_with_first_key() -> None:
    rotated = Cipher([NEW, OLD])
    token = rotated.seal({"b": 2})
    assert Cipher([NEW]).open(token) == {"b": 2}
    with pytest.raises(DecryptionError):
        Cipher([OLD]).open(token)


def test_rotate_reseals_old_token_with_first_key() -> None:
    old_token = Cipher([OLD]).seal("x")
    new_token = Cipher([NEW, OLD]).rotate(old_token)
    assert new_token != old_token
    assert Cipher([NEW]).open(new_token) == "x"


def test_token_of_key_removed_after_rotation_is_refused() -> None:
    old_token = Cipher([OLD]).seal("x")
    with pytest.raises(DecryptionError, match="unknown key"):
        Cipher([NEW]).open(old_token)


def test_token_from_unknown_key_is_refused() -> None:
    token = Cipher([OTHER]).seal({"a": 1})
    with pytest.raises(DecryptionError) as info:
        Cipher([NEW, OLD]).decrypt(token)
    assert str(info.value) == MESSAGE


def _flip(token: str, index: int) -> str:
    raw = bytearray(base64.urlsafe_b64decode(token))
    raw[index] ^= 0x01
    return base64.urlsafe_b64encode(bytes(raw)).decode("ascii")


@pytest.mark.parametrize("index", [0, 9, 30, -1, -20])
def test_tampered_token_is_refused(index: int) -> None:
    cipher = Cipher([NEW])
    token = cipher.seal({"a": 1})
    with pytest.raises(DecryptionError) as info:
        cipher.open(_flip(token, index))
    assert str(info.value) == MESSAGE
    assert "\n" not in str(info.value)


def test_truncated_token_is_refused() -> None:
    cipher = Cipher([NEW])
    token = cipher.seal({"a": 1})
    with pytest.raises(DecryptionError):
        cipher.decrypt(token[:-8])


@pytest.mark.parametrize("garbage", ["", "garbage", "!!!!", b"\xff\xfe\x00", b"", "=" * 10])
def test_garbage_is_refused(garbage: str | bytes) -> None:
    with pytest.raises(DecryptionError) as info:
        Cipher([NEW]).decrypt(garbage)
    assert str(info.value) == MESSAGE


def test_non_ascii_str_token_is_refused_as_decryption_error() -> None:
    with pytest.raises(DecryptionError):
        Cipher([NEW]).decrypt("gAAAAAB-tökén")


def test_decryption_error_hides_the_cause() -> None:
    with pytest.raises(DecryptionError) as info:
        Cipher([NEW]).decrypt("garbage")
    assert info.value.__cause__ is None
    assert info.value.__suppress_context__


def test_open_of_authentic_non_json_is_a_serialization_error() -> None:
    cipher = Cipher([NEW])
    with pytest.raises(SerializationError):
        cipher.open(cipher.encrypt(b"not json"))


def test_invalid_key_is_refused_at_construction() -> None:
    with pytest.raises(ValueError):
        Cipher(["not-a-key"])


def test_sign_verify_and_rotation() -> None:
    old, new = Fernet.generate_key().decode(), Fernet.generate_key().decode()
    mac = Cipher([old]).sign(b"fields")
    assert Cipher([old]).verify(b"fields", mac)
    assert Cipher([new, old]).verify(b"fields", mac)  # still accepted while listed
    assert not Cipher([new]).verify(b"fields", mac)  # the old key is gone
    assert not Cipher([old]).verify(b"fieldz", mac)  # other data
    assert not Cipher([old]).verify(b"fields", mac[:-1] + ("A" if mac[-1] != "A" else "B"))
    assert Cipher([new, old]).sign(b"fields") == Cipher([new]).sign(b"fields")


def test_mac_is_not_the_fernet_key_itself() -> None:
    key = Fernet.generate_key().decode()
    assert key.rstrip("=") not in Cipher([key]).sign(b"")
