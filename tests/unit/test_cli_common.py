"""deferral_cli.common: the one line for an unreachable server, and listings as table or JSON."""

from __future__ import annotations

import datetime as dt
import io
import json
import sys
from pathlib import Path

import click
import psycopg
import pytest
import redis.exceptions
from click.testing import CliRunner
from cryptography.fernet import Fernet
from sqlalchemy.exc import IntegrityError, OperationalError, ProgrammingError

from deferral.runtime.config import Settings, load_settings
from deferral_cli.common import (
    EXIT_FAILED,
    EXIT_UNAVAILABLE,
    cell,
    emit,
    not_found_message,
    output_options,
    server_error,
)
from deferral_cli.group import terminal_safe_output

REFUSED = (
    'connection failed: connection to server at "10.0.0.7", port 5433 failed: Connection refused\n'
    "\tIs the server running on that host and accepting TCP/IP connections?"
)


@pytest.fixture
def settings() -> Settings:
    return load_settings(
        {
            "DEFERRAL_DATABASE_URL": "postgresql://deferral:s3cret@db.example:5433/prod",
            "DEFERRAL_REDIS_URL": "redis://:s3cret@cache.example:6380/0",
            "DEFERRAL_FERNET_KEY": Fernet.generate_key().decode(),
        },
        toml_path=Path("/nonexistent"),
    )


def _db_error(orig: BaseException) -> OperationalError:
    return OperationalError("SELECT 1", {}, orig)


def _redis_refused() -> redis.exceptions.ConnectionError:
    """As redis-py raises it: its own message, the socket's error as the context."""
    try:
        try:
            raise ConnectionRefusedError(111, "Connection refused")
        except OSError:
            raise redis.exceptions.ConnectionError(
                "Error 111 connecting to cache.example:6380. Connection refused."
            ) from None
    except redis.exceptions.ConnectionError as exc:
        return exc


@pytest.mark.parametrize(
    ("orig", "line"),
    [
        (
            psycopg.OperationalError(REFUSED),
            "cannot reach PostgreSQL at db.example:5433/prod: connection refused",
        ),
        (
            psycopg.OperationalError(
                'connection failed: connection to server at "10.0.0.7", port 5433 failed:'
                ' FATAL:  database "prod" does not exist'
            ),
            'cannot reach PostgreSQL at db.example:5433/prod: database "prod" does not exist',
        ),
        (
            psycopg.OperationalError(
                "failed to resolve host 'db.example': [Errno -2] Name or service not known"
            ),
            "cannot reach PostgreSQL at db.example:5433/prod: failed to resolve host"
            " 'db.example': [Errno -2] Name or service not known",
        ),
        (
            psycopg.errors.AdminShutdown("terminating connection due to administrator command"),
            "cannot reach PostgreSQL at db.example:5433/prod: terminating connection due to"
            " administrator command",
        ),
        (
            psycopg.errors.SerializationFailure("could not serialize access"),
            "PostgreSQL at db.example:5433/prod is busy: could not serialize access; try again",
        ),
    ],
    ids=["refused", "no database", "unknown host", "shutdown", "serialization"],
)
def test_an_unavailable_database_is_one_line_naming_it_without_the_password(
    settings: Settings, orig: BaseException, line: str
) -> None:
    assert server_error(_db_error(orig), settings) == (line, EXIT_UNAVAILABLE)
    assert "s3cret" not in line


def test_an_unreachable_redis_is_one_line_with_the_sockets_reason(settings: Settings) -> None:
    assert server_error(_redis_refused(), settings) == (
        "cannot reach Redis at cache.example:6380: connection refused",
        EXIT_UNAVAILABLE,
    )
    busy = redis.exceptions.BusyLoadingError("Redis is loading the dataset in memory")
    assert server_error(busy, settings) == (
        "Redis at cache.example:6380 is busy: Redis is loading the dataset in memory; try again",
        EXIT_UNAVAILABLE,
    )


def test_the_error_a_command_raised_from_an_unreachable_server_counts(settings: Settings) -> None:
    try:
        try:
            raise _db_error(psycopg.OperationalError(REFUSED))
        except OperationalError as exc:
            raise RuntimeError("could not load the variable") from exc
    except RuntimeError as wrapped:
        said = server_error(wrapped, settings)
    assert said is not None and said[0].startswith("cannot reach PostgreSQL at db.example:5433")


def test_without_settings_the_server_is_named_without_a_place() -> None:
    said = server_error(_db_error(psycopg.OperationalError(REFUSED)), None)
    assert said == ("cannot reach PostgreSQL: connection refused", EXIT_UNAVAILABLE)


def test_a_missing_schema_says_to_upgrade(settings: Settings) -> None:
    missing = ProgrammingError("SELECT", {}, psycopg.errors.UndefinedTable("no dag_run"))
    assert server_error(missing, settings) == (
        "PostgreSQL at db.example:5433/prod lacks deferral's tables (or some of them):"
        " run `deferral db upgrade`",
        EXIT_FAILED,
    )


@pytest.mark.parametrize(
    "exc",
    [
        ValueError("bad"),
        IntegrityError("INSERT", {}, psycopg.errors.UniqueViolation("duplicate key")),
        redis.exceptions.ResponseError("WRONGTYPE Operation against a key"),
    ],
    ids=repr,
)
def test_other_errors_are_left_alone(settings: Settings, exc: BaseException) -> None:
    assert server_error(exc, settings) is None


# -- listings ----------------------------------------------------------------------------------

MOMENT = dt.datetime(2024, 5, 1, 12, 0, 7, 123456, tzinfo=dt.UTC)
RECORDS = [
    {"name": "a", "count": 3, "at": MOMENT, "age_sec": 1.25, "tags": ["x", "y"], "ok": True},
    {"name": "bb", "count": 10, "at": None, "age_sec": 0.0, "tags": [], "ok": False},
]


@click.command()
@output_options
def listing(output: str) -> None:
    emit(output, RECORDS, empty="nothing", cells={"count": lambda n: f"#{n}"})


def test_a_listing_prints_a_table_under_the_keys() -> None:
    result = CliRunner().invoke(listing, [])
    assert result.exit_code == 0, result.output
    assert result.output.splitlines() == [
        "NAME  COUNT  AT                         AGE_SEC  TAGS  OK",
        "a     #3     2024-05-01T12:00:07+00:00  1.2      x, y  True",
        "bb    #10    -                          0.0      -     False",
    ]


@pytest.mark.parametrize("args", [["--json"], ["--output", "json"], ["-o", "json"]])
def test_a_listing_prints_json_with_typed_values(args: list[str]) -> None:
    result = CliRunner().invoke(listing, args)
    assert result.exit_code == 0, result.output
    assert json.loads(result.output) == [
        {
            "name": "a",
            "count": 3,
            "at": "2024-05-01T12:00:07.123456+00:00",
            "age_sec": 1.25,
            "tags": ["x", "y"],
            "ok": True,
        },
        {"name": "bb", "count": 10, "at": None, "age_sec": 0.0, "tags": [], "ok": False},
    ]


def test_an_empty_listing_says_so_or_is_an_empty_array() -> None:
    @click.command()
    @output_options
    def empty(output: str) -> None:
        emit(output, [], empty="no things")

    assert CliRunner().invoke(empty, []).output == "no things\n"
    assert json.loads(CliRunner().invoke(empty, ["--json"]).output) == []


def test_a_listing_refuses_an_unknown_format_naming_the_option() -> None:
    result = CliRunner().invoke(listing, ["--output", "yaml"])
    assert result.exit_code == 2
    assert "--output" in result.output and "'yaml' is not one of" in result.output


def test_cells() -> None:
    assert cell({"t1": 2, "t2": 1}) == "t1=2 t2=1"
    assert cell({}) == "-"
    assert cell(dt.timedelta(seconds=3)) == "0:00:03"


def test_everything_printed_during_a_command_is_terminal_safe() -> None:
    out, err = io.StringIO(), io.StringIO()
    saved = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = out, err
    try:
        with terminal_safe_output():
            click.echo("run r\x1b[2J\x9b1m\u202e\tok\r\nnext", color=True)  # color: as on a tty
            click.echo("error: task t\x1b]0;x\x07", err=True)
            print("a\x00b", file=sys.stdout)
            sys.stdout.writelines(["\x07", "\n"])
            with pytest.raises(TypeError):
                sys.stdout.write(b"\x1b")  # type: ignore[arg-type]
        assert (sys.stdout, sys.stderr) == (out, err)  # restored
    finally:
        sys.stdout, sys.stderr = saved
    assert out.getvalue() == "run r\\x1b[2J\\x9b1m\\u202e\tok\\x0d\nnext\na\\x00b\n\\x07\n"
    assert err.getvalue() == "error: task t\\x1b]0;x\\x07\n"


def test_a_dag_not_found_names_the_files_that_fail_to_import() -> None:
    """Named, not only counted: under `dags test` on its embedded database, the `dags list`
    that would show them cannot reach it."""
    missing = "DAG 'd' not found in /dags"
    one = {"/dags/a.py": "ModuleNotFoundError: No module named 'httpx' (line 2)"}
    assert not_found_message(missing, "d", None, one) == (
        f"{missing}; 1 DAG file fails to import: /dags/a.py: ModuleNotFoundError: No module"
        " named 'httpx' (line 2)"
    )
    four = {f"/dags/{n}.py": f"E{n}" for n in "dcba"}
    assert not_found_message(missing, "d", None, four) == (
        f"{missing}; 4 DAG files fail to import: /dags/a.py: Ea; /dags/b.py: Eb; /dags/c.py: Ec;"
        " `deferral dags list` shows the others"
    )
    assert not_found_message(missing, "d", "/dags/b.py", four) == (
        "DAG 'd' is in /dags/b.py, which fails to import: Eb"
    )
    assert not_found_message(missing, "d", None, {}) == missing
