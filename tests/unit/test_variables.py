"""deferral.variables without a database: the environment first, JSON, keys, and the accessor
templates use. (The table: tests/integration/test_variables_connections.py.)"""

from __future__ import annotations

import copy
import pickle

import pytest

from deferral import Variable
from deferral.runtime.secrets_masker import redact
from deferral.variables import VariableAccessor, VariableError


@pytest.fixture(autouse=True)
def _no_database(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DEFERRAL_DATABASE_URL", "postgresql+psycopg://nobody@127.0.0.1:1/none")
    monkeypatch.setenv("DEFERRAL_FERNET_KEY", "u3p5mQ3YXbhOKWSFHl_NS1g6G0mwoyNu3B6Q38eTtuQ=")


def test_the_environment_is_read_first(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DEFERRAL_VAR_BUCKET", "s3://bucket")
    monkeypatch.setenv("DEFERRAL_VAR_LIMITS", '{"max": 3, "names": ["a"]}')
    assert Variable.get("bucket") == "s3://bucket"
    assert Variable.get("BUCKET") == "s3://bucket"  # the name is the key upper-cased
    assert Variable.get("limits", deserialize_json=True) == {"max": 3, "names": ["a"]}
    assert Variable.get("limits") == '{"max": 3, "names": ["a"]}'


def test_json_that_is_not_json_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DEFERRAL_VAR_BROKEN", "{not json")
    with pytest.raises(VariableError, match="variable 'broken' is not valid JSON"):
        Variable.get("broken", deserialize_json=True)


@pytest.mark.parametrize("key", ["", "   ", "k" * 251, 7])
def test_bad_keys_are_refused(key: object) -> None:
    with pytest.raises(VariableError, match="variable key"):
        Variable.get(key)  # type: ignore[arg-type]


def test_secret_looking_variables_are_masked_once_read(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DEFERRAL_VAR_SERVICE_PASSWORD", "hunter2-long")
    monkeypatch.setenv("DEFERRAL_VAR_PLAIN_NAME", "visible-value")
    monkeypatch.setenv("DEFERRAL_VAR_NESTED", '{"api_key": "nested-key-77", "region": "eu"}')
    Variable.get("service_password")
    Variable.get("plain_name")
    Variable.get("nested", deserialize_json=True)
    assert redact("a hunter2-long b visible-value c nested-key-77 d eu") == (
        "a *** b visible-value c *** d eu"
    )


def test_the_template_accessor(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DEFERRAL_VAR_CFG", '{"a": [1, 2]}')
    value, as_json = (
        VariableAccessor(deserialize_json=False),
        VariableAccessor(deserialize_json=True),
    )
    assert value.cfg == '{"a": [1, 2]}'
    assert as_json.cfg == {"a": [1, 2]}
    assert as_json.get("cfg") == {"a": [1, 2]}
    # Copying or pickling a context never looks a dunder up as a variable.
    assert copy.deepcopy(value) is not value
    assert pickle.loads(pickle.dumps(as_json)).cfg == {"a": [1, 2]}
