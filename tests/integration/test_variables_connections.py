"""Variables and Connections against the real table: sealed in Postgres, the environment first,
clear errors for a missing key or a wrong Fernet key; what templates rendered to, per try."""

from __future__ import annotations

import pytest
from click.testing import CliRunner
from cryptography.fernet import Fernet
from sqlalchemy import select, text
from sqlalchemy.orm import Session, sessionmaker

from deferral import Connection, Variable
from deferral.authoring.templating import record_rendered_fields
from deferral.connections import (
    ConnectionExists,
    ConnectionNotFound,
    InvalidConnection,
    add_stored,
    read_stored,
)
from deferral.hooks.base import BaseHook
from deferral.runtime.config import Settings
from deferral.runtime.crypto import Cipher, Purpose
from deferral.store.tables import RenderedTaskInstanceFields
from deferral.variables import VariableError
from deferral_cli import main as deferral_main
from tests.integration.factories import running_task


def _raw(sessions: sessionmaker[Session], sql: str) -> list[tuple[object, ...]]:
    with sessions() as session:
        return [tuple(row) for row in session.execute(text(sql)).all()]


# -- Variables -----------------------------------------------------------------------------------


def test_a_variable_is_ciphertext_in_postgres_and_reads_back(
    settings: Settings, sessions: sessionmaker[Session], cipher: Cipher
) -> None:
    Variable.set("db_password", "hunter2-in-table", description="for the warehouse")
    Variable.set("limits", {"max": 3, "names": ["a"]}, serialize_json=True)
    [(val, encrypted, description)] = _raw(
        sessions, "SELECT val, is_encrypted, description FROM variable WHERE key = 'db_password'"
    )
    assert isinstance(val, str) and "hunter2" not in val
    assert cipher.decrypt(Purpose.STORED_SECRET, val) == b"hunter2-in-table"
    assert (encrypted, description) == (True, "for the warehouse")
    assert Variable.get("db_password") == "hunter2-in-table"
    assert Variable.get("limits", deserialize_json=True) == {"max": 3, "names": ["a"]}

    Variable.set("db_password", "changed-value")  # no description given: the old one stays
    assert _raw(sessions, "SELECT description FROM variable WHERE key = 'db_password'") == [
        ("for the warehouse",)
    ]
    assert Variable.get("db_password") == "changed-value"


def test_the_environment_wins_over_the_table(
    settings: Settings, sessions: sessionmaker[Session], monkeypatch: pytest.MonkeyPatch
) -> None:
    Variable.set("region", "from-table")
    monkeypatch.setenv("DEFERRAL_VAR_REGION", "from-env")
    assert Variable.get("region") == "from-env"
    monkeypatch.delenv("DEFERRAL_VAR_REGION")
    assert Variable.get("region") == "from-table"


def test_a_missing_variable_is_a_key_error_naming_it_unless_a_default_is_given(
    settings: Settings, sessions: sessionmaker[Session]
) -> None:
    with pytest.raises(KeyError) as info:
        Variable.get("nope")
    assert str(info.value) == "Variable nope does not exist"
    assert Variable.get("nope", default_var=None) is None
    assert Variable.get("nope", default_var={"d": 1}, deserialize_json=True) == {"d": 1}


def test_update_setdefault_and_delete(settings: Settings, sessions: sessionmaker[Session]) -> None:
    with pytest.raises(KeyError, match="Variable counter does not exist"):
        Variable.update("counter", 1)
    assert Variable.setdefault("counter", {"n": 1}, deserialize_json=True) == {"n": 1}
    assert Variable.setdefault("counter", {"n": 2}, deserialize_json=True) == {"n": 1}
    Variable.update("counter", {"n": 3}, serialize_json=True)
    assert Variable.get("counter", deserialize_json=True) == {"n": 3}
    assert Variable.delete("counter") == 1
    assert Variable.delete("counter") == 0


def test_a_wrong_fernet_key_fails_with_a_clear_error(
    settings: Settings, sessions: sessionmaker[Session], monkeypatch: pytest.MonkeyPatch
) -> None:
    Variable.set("sealed", "value")
    monkeypatch.setenv("DEFERRAL_FERNET_KEY", Fernet.generate_key().decode())
    with pytest.raises(VariableError) as info:
        Variable.get("sealed")
    assert str(info.value) == (
        "variable 'sealed' cannot be decrypted with DEFERRAL_FERNET_KEY (sealed with another key?)"
    )


def test_a_row_written_unencrypted_reads_as_it_is(
    settings: Settings, sessions: sessionmaker[Session]
) -> None:
    with sessions.begin() as session:
        session.execute(text("INSERT INTO variable (key, val) VALUES ('legacy', 'plain text')"))
    assert Variable.get("legacy") == "plain text"


# -- Connections ---------------------------------------------------------------------------------


def test_a_connection_password_and_extra_are_ciphertext_in_postgres(
    settings: Settings, sessions: sessionmaker[Session], cipher: Cipher
) -> None:
    conn = Connection(
        conn_id="warehouse",
        uri="postgres://etl:pw-in-postgres@db.example.com:5432/dw?sslmode=require&token=t0ken-x",
        description="the warehouse",
    )
    with sessions.begin() as session:
        add_stored(session, cipher, conn)
    [(login, host, password, extra)] = _raw(
        sessions, "SELECT login, host, password, extra FROM connection"
    )
    assert (login, host) == ("etl", "db.example.com")
    assert isinstance(password, str) and "pw-in-postgres" not in password
    assert isinstance(extra, str) and "sslmode" not in extra and "t0ken" not in extra
    assert cipher.decrypt(Purpose.STORED_SECRET, password) == b"pw-in-postgres"

    found = BaseHook.get_connection("warehouse")
    assert (found.password, found.port, found.schema, found.description) == (
        "pw-in-postgres",
        5432,
        "dw",
        "the warehouse",
    )
    assert found.extra_dejson == {"sslmode": "require", "token": "t0ken-x"}
    assert found.get_uri() == conn.get_uri()

    with sessions.begin() as session, pytest.raises(ConnectionExists, match="'warehouse'"):
        add_stored(session, cipher, conn)


def test_connections_from_the_environment_win_and_a_missing_one_is_named(
    settings: Settings,
    sessions: sessionmaker[Session],
    cipher: Cipher,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with sessions.begin() as session:
        add_stored(session, cipher, Connection(conn_id="api", conn_type="http", host="table"))
    monkeypatch.setenv("DEFERRAL_CONN_API", "http://env-host")
    assert Connection.get_connection_from_secrets("api").host == "env-host"
    monkeypatch.delenv("DEFERRAL_CONN_API")
    assert Connection.get_connection_from_secrets("api").host == "table"
    with pytest.raises(ConnectionNotFound, match="The conn_id `nowhere` isn't defined"):
        BaseHook.get_connection("nowhere")


def test_a_connection_sealed_with_another_key_fails_with_a_clear_error(
    settings: Settings, sessions: sessionmaker[Session]
) -> None:
    other = Cipher([Fernet.generate_key().decode()])
    with sessions.begin() as session:
        add_stored(session, other, Connection(conn_id="old", conn_type="http", password="pw"))
    with pytest.raises(InvalidConnection) as info:
        BaseHook.get_connection("old")
    assert str(info.value) == (
        "connection 'old': its password cannot be decrypted with DEFERRAL_FERNET_KEY "
        "(sealed with another key?)"
    )


def test_rotate_fernet_key_reseals_variables_and_connections(
    settings: Settings,
    sessions: sessionmaker[Session],
    cipher: Cipher,
    fernet_key: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    Variable.set("sealed", "v")
    with sessions.begin() as session:
        session.execute(text("INSERT INTO variable (key, val) VALUES ('legacy', 'plain')"))
        add_stored(session, cipher, Connection(conn_id="c", uri="http://u:p@h?x=1"))
    new_key = Fernet.generate_key().decode()
    monkeypatch.setenv("DEFERRAL_FERNET_KEY", f"{new_key},{fernet_key}")
    result = CliRunner().invoke(deferral_main, ["rotate-fernet-key"])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    first = lines.index("variable.val: 1 row(s) rotated")  # among the other sealed columns'
    assert lines[first : first + 3] == [
        "variable.val: 1 row(s) rotated",
        "connection.password: 1 row(s) rotated",
        "connection.extra: 1 row(s) rotated",
    ]
    monkeypatch.setenv("DEFERRAL_FERNET_KEY", new_key)  # the old key is gone
    assert (Variable.get("sealed"), Variable.get("legacy")) == ("v", "plain")
    with sessions() as session:
        conn = read_stored(session, Cipher([new_key]), "c")
    assert conn is not None and (conn.password, conn.extra_dejson) == ("p", {"x": "1"})


# -- rendered fields ------------------------------------------------------------------------------


def test_rendered_fields_are_kept_per_try_and_a_resumed_try_overwrites_its_row(
    settings: Settings, sessions: sessionmaker[Session]
) -> None:
    ti_id = running_task(sessions)
    for try_number, rendered in ((1, {"f": "first"}), (1, {"f": "resumed"}), (2, {"f": "two"})):
        with sessions.begin() as session:
            record_rendered_fields(session, ti_id, try_number, rendered)
    with sessions() as session:
        rows = session.execute(
            select(RenderedTaskInstanceFields.try_number, RenderedTaskInstanceFields.rendered)
            .where(RenderedTaskInstanceFields.task_instance_id == ti_id)
            .order_by(RenderedTaskInstanceFields.try_number)
        ).all()
    assert [tuple(row) for row in rows] == [(1, {"f": "resumed"}), (2, {"f": "two"})]
