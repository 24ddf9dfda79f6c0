"""deferral.secrets_masker: Airflow's sensitive names, and redaction of registered secrets."""

from __future__ import annotations

import pytest

from deferral.secrets_masker import MASK, SecretsMasker, should_hide_value_for_key


@pytest.mark.parametrize(
    ("name", "hidden"),
    [
        ("password", True),
        ("DB_PASSWORD", True),
        ("aws_secret_access_key", True),
        ("passwd", True),
        ("Authorization", True),
        ("my_api_key", True),
        ("apikey", True),
        ("access_token", True),
        ("private_key_file", True),
        ("region", False),
        ("", False),
        (None, False),
    ],
)
def test_sensitive_names(name: object, hidden: bool) -> None:
    assert should_hide_value_for_key(name) is hidden


def test_registered_secrets_are_masked_anywhere_in_nested_values() -> None:
    masker = SecretsMasker()
    masker.add_mask("abcde")
    masker.add_mask("abcdefgh")  # a secret containing another is masked whole
    masker.add_mask("not-secret", "region")  # a harmless name: not registered
    masker.add_mask({"token": "token-1", "user": "bob-the-user"})
    value = {
        "cmd": "run abcdefgh then abcde with token-1 as bob-the-user in not-secret",
        "list": ["abcde", ("x abcde", 3)],
        "password": {"any": "thing", "n": 5},
        "n": None,
    }
    assert masker.redact(value) == {
        "cmd": f"run {MASK} then {MASK} with {MASK} as bob-the-user in not-secret",
        "list": [MASK, (f"x {MASK}", 3)],
        "password": {"any": MASK, "n": MASK},
        "n": None,
    }
    assert masker.redact("whole", "api_key") == MASK


def test_a_short_secret_is_masked_only_as_a_whole_value() -> None:
    masker = SecretsMasker()
    masker.add_mask("pw1")
    assert masker.redact(["pw1", "pw1 in a pw1x sentence"]) == [MASK, "pw1 in a pw1x sentence"]


def test_a_masker_with_no_secrets_changes_nothing() -> None:
    assert SecretsMasker().redact({"a": "b"}) == {"a": "b"}
