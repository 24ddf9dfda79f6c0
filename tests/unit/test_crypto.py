"""deferral.runtime.crypto: Fernet sealing with key rotation, each purpose under a key of its
own; every bad token is a DecryptionError."""

from __future__ import annotations

import base64
import datetime as dt
from typing import Any

import pytest
from cryptography.fernet import Fernet, InvalidToken, MultiFernet

from deferral.runtime.crypto import LEGACY_READABLE, Cipher, DecryptionError, Purpose
from deferral.runtime.serialization import SerializationError

OLD = Fernet.generate_key().decode()
NEW = Fernet.generate_key().decode()
OTHER = Fernet.generate_key().decode()

# The purpose of the generic cases: one never read as sealed before purposes.
P = Purpose.TRIGGER_SPEC
MESSAGE = (
    "token failed authentication as a trigger spec (forged, corrupted, sealed for another"
    " purpose or with an unknown key)"
)


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
    token = cipher.seal(P, value)
    assert isinstance(token, str)
    assert cipher.open(P, token) == value
    assert cipher.open(P, token.encode("ascii")) == value


def test_sealed_token_does_not_show_the_plaintext() -> None:
    cipher = Cipher([NEW])
    token = cipher.seal(P, {"password": "hunter2-very-secret"})
    assert "hunter2" not in token
    assert b"hunter2" not in base64.urlsafe_b64decode(token)


def test_encrypt_decrypt_bytes() -> None:
    cipher = Cipher([NEW])
    assert cipher.decrypt(P, cipher.encrypt(P, b"\x00\xffabc")) == b"\x00\xffabc"


def test_seal_refuses_unserializable_value_naming_where() -> None:
    with pytest.raises(SerializationError) as info:
        Cipher([NEW]).seal(P, {"conn": object()}, "next_kwargs")
    assert "next_kwargs['conn']" in str(info.value)
    assert "object" in str(info.value)


def test_rotation_old_token_opens_when_old_key_is_second() -> None:
    old_token = Cipher([OLD]).seal(P, {"a": 1})
    rotated = Cipher([NEW, OLD])
    assert rotated.open(P, old_token) == {"a": 1}


def test_rotation_new_tokens_are_made_with_first_key() -> None:
    rotated = Cipher([NEW, OLD])
    token = rotated.seal(P, {"b": 2})
    assert Cipher([NEW]).open(P, token) == {"b": 2}
    with pytest.raises(DecryptionError):
        Cipher([OLD]).open(P, token)


def test_rotate_reseals_old_token_with_first_key() -> None:
    old_token = Cipher([OLD]).seal(P, "x")
    new_token = Cipher([NEW, OLD]).rotate(P, old_token)
    assert new_token != old_token
    assert Cipher([NEW]).open(P, new_token) == "x"


def test_token_of_key_removed_after_rotation_is_refused() -> None:
    old_token = Cipher([OLD]).seal(P, "x")
    with pytest.raises(DecryptionError, match="unknown key"):
        Cipher([NEW]).open(P, old_token)


def test_token_from_unknown_key_is_refused() -> None:
    token = Cipher([OTHER]).seal(P, {"a": 1})
    with pytest.raises(DecryptionError) as info:
        Cipher([NEW, OLD]).decrypt(P, token)
    assert str(info.value) == MESSAGE


def _flip(token: str, index: int) -> str:
    raw = bytearray(base64.urlsafe_b64decode(token))
    raw[index] ^= 0x01
    return base64.urlsafe_b64encode(bytes(raw)).decode("ascii")


@pytest.mark.parametrize("index", [0, 9, 30, -1, -20])
def test_tampered_token_is_refused(index: int) -> None:
    cipher = Cipher([NEW])
    token = cipher.seal(P, {"a": 1})
    with pytest.raises(DecryptionError) as info:
        cipher.open(P, _flip(token, index))
    assert str(info.value) == MESSAGE
    assert "\n" not in str(info.value)


def test_truncated_token_is_refused() -> None:
    cipher = Cipher([NEW])
    token = cipher.seal(P, {"a": 1})
    with pytest.raises(DecryptionError):
        cipher.decrypt(P, token[:-8])


@pytest.mark.parametrize("garbage", ["", "garbage", "!!!!", b"\xff\xfe\x00", b"", "=" * 10])
def test_garbage_is_refused(garbage: str | bytes) -> None:
    with pytest.raises(DecryptionError) as info:
        Cipher([NEW]).decrypt(P, garbage)
    assert str(info.value) == MESSAGE


def test_non_ascii_str_token_is_refused_as_decryption_error() -> None:
    with pytest.raises(DecryptionError):
        Cipher([NEW]).decrypt(P, "gAAAAAB-tökén")


def test_decryption_error_hides_the_cause() -> None:
    with pytest.raises(DecryptionError) as info:
        Cipher([NEW]).decrypt(P, "garbage")
    assert info.value.__cause__ is None
    assert info.value.__context__ is None or info.value.__suppress_context__


def test_open_of_authentic_non_json_is_a_serialization_error() -> None:
    cipher = Cipher([NEW])
    with pytest.raises(SerializationError):
        cipher.open(P, cipher.encrypt(P, b"not json"))


def test_invalid_key_is_refused_at_construction() -> None:
    with pytest.raises(ValueError):
        Cipher(["not-a-key"])


def test_sign_verify_and_rotation() -> None:
    old, new = Fernet.generate_key().decode(), Fernet.generate_key().decode()
    mac = Cipher([old]).sign(Purpose.STREAM_ENTRY, b"fields")
    assert Cipher([old]).verify(Purpose.STREAM_ENTRY, b"fields", mac)
    assert Cipher([new, old]).verify(
        Purpose.STREAM_ENTRY, b"fields", mac
    )  # still accepted while listed
    assert not Cipher([new]).verify(Purpose.STREAM_ENTRY, b"fields", mac)  # the old key is gone
    assert not Cipher([old]).verify(Purpose.STREAM_ENTRY, b"fieldz", mac)  # other data
    assert not Cipher([old]).verify(
        Purpose.STREAM_ENTRY, b"fields", mac[:-1] + ("A" if mac[-1] != "A" else "B")
    )
    assert Cipher([new, old]).sign(Purpose.STREAM_ENTRY, b"fields") == Cipher([new]).sign(
        Purpose.STREAM_ENTRY, b"fields"
    )


def test_mac_is_not_the_fernet_key_itself() -> None:
    key = Fernet.generate_key().decode()
    assert key.rstrip("=") not in Cipher([key]).sign(Purpose.STREAM_ENTRY, b"")


# -- purposes -------------------------------------------------------------------------------------


@pytest.mark.parametrize("sealed_for", list(Purpose))
def test_a_blob_sealed_for_one_purpose_opens_for_no_other(sealed_for: Purpose) -> None:
    cipher = Cipher([NEW])
    token = cipher.encrypt(sealed_for, b'{"trigger_id": 1}')
    assert cipher.decrypt(sealed_for, token) == b'{"trigger_id": 1}'
    for other in Purpose:
        if other is not sealed_for:
            with pytest.raises(DecryptionError, match=f"as a {other.value} "):
                cipher.decrypt(other, token)
    with pytest.raises(InvalidToken):  # nor with the configured key itself
        Fernet(NEW).decrypt(token.encode())


@pytest.mark.parametrize("purpose", list(Purpose))
def test_rotation_holds_for_every_purpose(purpose: Purpose) -> None:
    old_token = Cipher([OLD]).encrypt(purpose, b"x")
    assert Cipher([NEW, OLD]).decrypt(purpose, old_token) == b"x"
    rotated = Cipher([NEW, OLD]).rotate(purpose, old_token)
    assert Cipher([NEW]).decrypt(purpose, rotated) == b"x"
    with pytest.raises(DecryptionError):
        Cipher([OLD]).decrypt(purpose, rotated)
    with pytest.raises(DecryptionError):
        Cipher([NEW]).decrypt(purpose, old_token)


@pytest.mark.parametrize("purpose", list(Purpose))
def test_what_was_sealed_before_purposes_opens_only_where_legacy_is_read(
    purpose: Purpose,
) -> None:
    legacy = MultiFernet([Fernet(NEW), Fernet(OLD)]).encrypt(b'{"a": 1}').decode()
    cipher = Cipher([NEW, OLD])
    if purpose in LEGACY_READABLE:
        assert cipher.decrypt(purpose, legacy) == b'{"a": 1}'
        assert Cipher([NEW]).decrypt(purpose, cipher.rotate(purpose, legacy)) == b'{"a": 1}'
    else:
        with pytest.raises(DecryptionError):
            cipher.decrypt(purpose, legacy)


def test_no_purpose_read_from_an_unauthenticated_redis_field_reads_legacy() -> None:
    # A signal payload sealed before the upgrade (its plaintext the sender's) must not pass
    # as a trigger spec or a dead letter.
    assert Purpose.TRIGGER_SPEC not in LEGACY_READABLE
    assert Purpose.DEAD_LETTER not in LEGACY_READABLE


def test_macs_are_bound_to_their_purpose() -> None:
    cipher = Cipher([NEW])
    mac = cipher.sign(Purpose.DEAD_LETTER, b"fields")
    assert cipher.verify(Purpose.DEAD_LETTER, b"fields", mac)
    assert not cipher.verify(Purpose.STREAM_ENTRY, b"fields", mac)
    assert not cipher.verify(Purpose.CALLBACK_TOKEN, b"fields", mac)
    # Entries in flight and callback tokens handed out before purposes stay valid.
    assert cipher.sign(Purpose.STREAM_ENTRY, b"x") == cipher.sign(Purpose.CALLBACK_TOKEN, b"x")
