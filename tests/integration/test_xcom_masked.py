"""XCom values pass the secrets masker wherever they are shown: the task page, the API and
``deferral xcom get|list`` mask a Connection's password (stored or in DEFERRAL_CONN_*) and a
secret Variable's value, though none of these processes ever read them themselves."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from click.testing import CliRunner
from sqlalchemy.orm import Session, sessionmaker
from starlette.testclient import TestClient

from broker.client import Broker
from deferral import variables
from deferral.runtime import serialization
from deferral.runtime.config import Settings
from deferral.runtime.crypto import Cipher, Purpose
from deferral.store import xcom
from deferral.store.stored_secrets import known_secrets, shown_xcom
from deferral.store.tables import StoredConnection
from deferral_cli import main as deferral_main
from tests.integration.factories import DAG_ID, running_task
from webserver.app import create_app

CONN_PASSWORD = "c0nn-canary-p4ss/word"  # "/" stands as %2F in a URI
VAR_SECRET = "v4r-canary-s3cret"
ENV_PASSWORD = "env-canary-p4ss"


@pytest.fixture
def pushed(
    settings: Settings,
    sessions: sessionmaker[Session],
    cipher: Cipher,
    monkeypatch: pytest.MonkeyPatch,
) -> int:
    """A task that returned the secrets, in clear, as its XComs."""
    monkeypatch.setenv("DEFERRAL_CONN_FROM_ENV", f"postgres://u:{ENV_PASSWORD}@db:5432/x")
    ti_id = running_task(sessions, task_id="leaks", run_id="r1")
    with sessions.begin() as session:
        session.add(
            StoredConnection(
                conn_id="warehouse",
                conn_type="postgres",
                password=cipher.encrypt(Purpose.STORED_SECRET, CONN_PASSWORD.encode()),
            )
        )
        variables.write_stored(session, cipher, "api_secret", VAR_SECRET)
        leaked = {
            "dsn": f"postgres://u:{CONN_PASSWORD}@h/db",
            "quoted": "postgres://u:c0nn-canary-p4ss%2Fword@h/db",
            "from_variable": VAR_SECRET,
            "env": [ENV_PASSWORD],
            "harmless": "kept",
        }
        for key, value in [("return_value", leaked), ("plain", CONN_PASSWORD)]:
            xcom.upsert(session, ti_id, key, serialization.to_jsonable(value))
    return ti_id


SECRETS = (CONN_PASSWORD, "c0nn-canary-p4ss%2Fword", VAR_SECRET, ENV_PASSWORD)


def _assert_masked(text: str) -> None:
    for secret in SECRETS:
        assert secret not in text
    assert "kept" in text and "***" in text


def test_the_masker_knows_every_stored_and_configured_secret(
    pushed: int, sessions: sessionmaker[Session], cipher: Cipher
) -> None:
    with sessions() as session:
        masker = known_secrets(session, cipher, {"DEFERRAL_CONN_X": f"http://u:{ENV_PASSWORD}@h"})
    stored = serialization.to_jsonable({"a": f"x{CONN_PASSWORD}y", "b": [ENV_PASSWORD, VAR_SECRET]})
    assert shown_xcom(masker, "return_value", stored) == {"a": "x***y", "b": ["***", "***"]}
    assert shown_xcom(masker, "db_password", serialization.to_jsonable("any")) == "***"


def test_a_secret_that_cannot_be_opened_is_passed_over(
    pushed: int, sessions: sessionmaker[Session], cipher: Cipher
) -> None:
    with sessions.begin() as session:
        session.add(
            StoredConnection(conn_id="sealed_elsewhere", conn_type="x", password="gAAAA-no")
        )
    with sessions() as session:
        masker = known_secrets(session, cipher, {"DEFERRAL_CONN_BAD": "not a uri"})
    assert masker.redact(f"<{CONN_PASSWORD}>") == "<***>"


@pytest.fixture
def web(settings: Settings, broker: Broker) -> Iterator[TestClient]:
    app = create_app(settings, host="127.0.0.1", environ={})
    with TestClient(app, base_url="http://localhost") as client:
        yield client


def test_the_task_page_and_the_api_mask_xcoms(pushed: int, web: TestClient) -> None:
    query = {"run_id": "r1", "task_id": "leaks"}
    page = web.get(f"/dags/{DAG_ID}/task_instance", params=query)
    answer = web.get(f"/api/v1/dags/{DAG_ID}/task_instance", params=query)
    assert page.status_code == answer.status_code == 200
    _assert_masked(page.text)
    _assert_masked(answer.text)
    xcoms = {x["key"]: x["value"] for x in answer.json()["xcoms"]}
    assert xcoms["plain"] == "***"
    assert xcoms["return_value"]["dsn"] == "postgres://u:***@h/db"


def test_xcom_get_and_list_mask_secrets(pushed: int, settings: Settings) -> None:
    runner = CliRunner()
    for args in (
        ["xcom", "get", DAG_ID, "r1", "leaks"],
        ["xcom", "get", DAG_ID, "r1", "leaks", "--key", "plain"],
        ["xcom", "list", DAG_ID, "r1"],
        ["xcom", "list", DAG_ID, "r1", "--json"],
    ):
        result = runner.invoke(deferral_main, args)
        assert result.exit_code == 0, result.output
        for secret in SECRETS:
            assert secret not in result.output, args
    got = json.loads(runner.invoke(deferral_main, ["xcom", "get", DAG_ID, "r1", "leaks"]).stdout)
    assert got == {
        "dsn": "postgres://u:***@h/db",
        "quoted": "postgres://u:***@h/db",
        "from_variable": "***",
        "env": ["***"],
        "harmless": "kept",
    }
