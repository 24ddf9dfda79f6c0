"""`deferral users create|list|delete` and `deferral webserver`'s start-up errors."""

from __future__ import annotations

import json
import socket

import pytest
from click.testing import CliRunner, Result
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from deferral.runtime.config import Settings
from deferral.store.tables import User
from deferral_cli import main as deferral_main
from webserver import users


def run(*args: str, stdin: str | None = None) -> Result:
    return CliRunner().invoke(deferral_main, list(args), input=stdin)


@pytest.fixture
def ready(settings: Settings, sessions: sessionmaker[Session]) -> sessionmaker[Session]:
    return sessions


def test_create_stores_an_argon2_hash_that_logs_in(ready: sessionmaker[Session]) -> None:
    created = run("users", "create", "ann", "--password-stdin", stdin="ann-password-1\n")
    assert created.exit_code == 0, created.output
    assert created.stdout == "user ann created\n"
    with ready() as session:
        stored = session.scalars(select(User.password_hash).where(User.username == "ann")).one()
        assert stored.startswith("$argon2id$") and "ann-password-1" not in stored
        assert users.authenticate(session, "ann", "ann-password-1", {}) is not None
        assert users.authenticate(session, "ann", "ann-password-2", {}) is None


def test_the_password_is_asked_twice_when_not_piped(ready: sessionmaker[Session]) -> None:
    mismatch = run("users", "create", "bob", stdin="bob-password-1\nother-password\n")
    assert mismatch.exit_code != 0
    created = run("users", "create", "bob", stdin="bob-password-1\nbob-password-1\n")
    assert created.exit_code == 0, created.output
    assert "bob-password-1" not in created.output


@pytest.mark.parametrize(
    ("args", "stdin", "message"),
    [
        (("bad name",), "long-enough-1\n", "error: user name 'bad name' is invalid: use 1-64"),
        (("cid",), "short\n", "error: the password must have at least 8 characters"),
    ],
)
def test_bad_names_and_short_passwords_are_refused(
    ready: sessionmaker[Session], args: tuple[str, ...], stdin: str, message: str
) -> None:
    refused = run("users", "create", *args, "--password-stdin", stdin=stdin)
    assert refused.exit_code == 1
    assert refused.stderr.startswith(message)
    with ready() as session:
        assert session.scalars(select(User)).all() == []


def test_a_taken_name_list_and_delete(ready: sessionmaker[Session]) -> None:
    assert (
        run("users", "create", "dee", "--password-stdin", stdin="dee-password-1\n").exit_code == 0
    )
    taken = run("users", "create", "dee", "--password-stdin", stdin="another-pass-1\n")
    assert (taken.exit_code, taken.stderr) == (1, "error: user 'dee' exists already\n")
    listed = json.loads(run("users", "list", "--json").stdout)
    assert [record["username"] for record in listed] == ["dee"]
    assert set(listed[0]) == {"username", "created_at"}
    assert run("users", "delete", "dee").stdout == "user dee deleted\n"
    gone = run("users", "delete", "dee")
    assert (gone.exit_code, gone.stderr) == (1, "error: no user 'dee'\n")
    assert run("users", "list").stdout == "no users\n"


def test_webserver_says_in_one_line_that_its_port_is_taken(settings: Settings) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        refused = run("webserver", "--port", str(port))
    assert refused.exit_code == 2
    assert refused.stderr == f"error: cannot listen on 127.0.0.1:{port}: Address already in use\n"


def test_webserver_names_a_malformed_port_setting(
    settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DEFERRAL_WEBSERVER_PORT", "80800")
    refused = run("webserver")
    assert refused.exit_code == 2
    assert refused.stderr == (
        "error: DEFERRAL_WEBSERVER_PORT is malformed: 80800 is not a TCP port (1-65535)\n"
    )
