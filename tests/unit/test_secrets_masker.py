"""deferral.runtime.secrets_masker: Airflow's sensitive names, and redaction of registered
secrets."""

from __future__ import annotations

import pytest

from deferral.runtime.secrets_masker import (
    MASK,
    SecretsMasker,
    mask_with_kwargs,
    secrets_in_kwargs,
    should_hide_value_for_key,
)


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


# -- a trigger's kwargs --------------------------------------------------------------------------


def test_the_secrets_of_a_url_are_its_user_info_and_query() -> None:
    kwargs = {
        "url": "https://bob:s3cr%2Fet-pw@api.example/jobs/7?token=q-s3cret-1&page=2#top",
        "poll_interval": 5,
    }
    found = secrets_in_kwargs(kwargs)
    assert {"bob:s3cr%2Fet-pw", "s3cr%2Fet-pw", "s3cr/et-pw", "q-s3cret-1"} <= found
    assert "token=q-s3cret-1&page=2" in found
    assert not any("api.example" in secret or "/jobs/7" in secret for secret in found)


def test_the_secrets_under_sensitive_names_at_any_depth() -> None:
    kwargs = {"headers": {"Authorization": "Bearer abc-123-xyz"}, "opts": [{"api_key": ["k-9876"]}]}
    assert secrets_in_kwargs(kwargs) == {"Bearer abc-123-xyz", "k-9876"}
    assert secrets_in_kwargs({"path": "/data/in", "n": 3, "url": "https://h/p"}) == set()


def test_an_event_is_masked_with_its_triggers_secrets() -> None:
    kwargs = {"url": "https://bob:pw-s3cret@h/x?apikey=key-s3cret", "password": "plain-s3cret"}
    payload = {
        "url": "https://bob:pw-s3cret@h/x?apikey=key-s3cret",
        "said": ["it answered key-s3cret and plain-s3cret"],
        "status": 200,
    }
    assert mask_with_kwargs(payload, kwargs) == {
        "url": f"https://{MASK}@h/x?{MASK}",
        "said": [f"it answered {MASK} and {MASK}"],
        "status": 200,
    }
    assert mask_with_kwargs({"status": 200}, {"url": "https://h/"}) == {"status": 200}
