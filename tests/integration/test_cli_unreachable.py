"""Every `deferral` command, with PostgreSQL or Redis unreachable (a port nobody listens on),
prints one line naming the server (host, port; never the password) and exits 2: no traceback.

The commands are found by walking the click command tree, so a new command is swept too; its
arguments come from the tables below (a command with an argument or required option they do not
cover fails here, asking for a value).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import click
import pytest
from click.testing import CliRunner
from cryptography.fernet import Fernet
from sqlalchemy.orm import Session, sessionmaker

from deferral_cli import main as deferral_main
from deferral_cli.embedded import free_port
from tests.integration.cli_tree import command_at, leaves
from tests.servers import REDIS_URL

DAG_ID = "unreachable_dag"
DAG_SOURCE = f"""
import datetime as dt
from deferral import DAG
from deferral.operators import EmptyOperator

with DAG("{DAG_ID}", schedule="@daily", start_date=dt.datetime(2024, 1, 1, tzinfo=dt.UTC)):
    EmptyOperator(task_id="a") >> EmptyOperator(task_id="b")
"""
PASSWORD = "s3cret-pw"

# Values of arguments, by parameter name (files are made per test, see _arguments).
ARGUMENTS = {
    "dag_id": DAG_ID,
    "run_id": "r1",
    "task_id": "a",
    "key": "k",
    "value": "v",
    "conn_id": "c",
    "username": "ann",
    "dead_id": "1-0",
    "dead_ids": "1-0",
    "task_instance_id": "1",
    "options": "Approve",
    "name": "bot",
}
# Options a command needs beyond its required arguments.
OPTIONS: dict[tuple[str, ...], list[str]] = {
    ("tasks", "mark"): ["--state", "success"],
    ("dags", "backfill"): ["-s", "2024-01-01", "-e", "2024-01-02"],
    ("connections", "add"): ["--conn-uri", "postgres://u:p@h:5432/db"],
    ("reshard-streams",): ["--shards", "1"],
    ("tokens", "create"): ["--scope", "signals"],
}
# Commands that need no PostgreSQL / no Redis at all.
WITHOUT_POSTGRES = {("streams",), ("dead", "list")}
# Commands that read Redis first and find nothing to act on (no dead letter 1-0): one line, exit 1.
NOTHING_IN_REDIS = {("dead", "show"), ("dead", "retry"), ("dead", "drop")}
# A container healthcheck: a server that does not answer makes it unhealthy (exit 1), one line
# per check; Docker reserves exit 2.
HEALTHCHECK = ("health",)
NEEDS_REDIS = {("streams",), ("doctor",), ("standalone",), ("webserver",), ("reshard-streams",)} | {
    ("dead", command) for command in ("list", "show", "retry", "drop")
}


COMMANDS = leaves(deferral_main)


def _arguments(path: tuple[str, ...], files: Path) -> list[str]:
    """Valid-looking arguments for the command at ``path``."""
    args = [*path, *OPTIONS.get(path, [])]
    given = set(OPTIONS.get(path, []))
    for param in command_at(deferral_main, path).params:
        if isinstance(param, click.Option):
            assert not param.required or given & set(param.opts), (
                f"add a value for option {param.opts[0]} of `deferral {' '.join(path)}` to OPTIONS"
            )
            continue
        if not param.required:
            continue
        if param.name == "filepath":
            source = files / "variables.json"
            source.write_text('{"k": "v"}')
            args.append(str(source if path[-1] == "import" else files / "exported.json"))
        else:
            assert param.name in ARGUMENTS, (
                f"add a value for argument {param.name} of `deferral {' '.join(path)}`"
            )
            args.append(ARGUMENTS[param.name])
    if path == ("standalone",):
        args += ["--home", str(files / "home")]
    return args


@pytest.fixture
def files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, stream_prefix: str) -> Path:
    """A DAGs folder holding the DAG the arguments name, and a working directory of its own."""
    dags = tmp_path / "dags"
    dags.mkdir()
    (dags / "unreachable_dag.py").write_text(DAG_SOURCE)
    monkeypatch.chdir(tmp_path)
    for key in [k for k in os.environ if k.startswith("DEFERRAL_")]:
        monkeypatch.delenv(key)
    monkeypatch.setenv("DEFERRAL_DAGS_FOLDER", str(dags))
    monkeypatch.setenv("DEFERRAL_FERNET_KEY", Fernet.generate_key().decode())
    # The run's own prefix, whose keys (the shard count a command records) are deleted after.
    monkeypatch.setenv("DEFERRAL_STREAM_PREFIX", stream_prefix)
    return tmp_path


def _invoke(args: list[str]) -> tuple[int, list[str]]:
    result = CliRunner().invoke(deferral_main, args)
    # SystemExit is how a command exits; any other exception would be a traceback.
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exc_info
    return result.exit_code, result.output.splitlines()


@pytest.mark.parametrize("path", COMMANDS, ids=" ".join)
def test_without_postgres_every_command_says_so_in_one_line(
    path: tuple[str, ...], files: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    port = free_port()
    monkeypatch.setenv(
        "DEFERRAL_DATABASE_URL", f"postgresql+psycopg://deferral:{PASSWORD}@127.0.0.1:{port}/prod"
    )
    monkeypatch.setenv("DEFERRAL_REDIS_URL", REDIS_URL)
    code, lines = _invoke(_arguments(path, files))
    if path in WITHOUT_POSTGRES:
        assert code == 0, lines
        return
    if path in NOTHING_IN_REDIS:
        assert code == 1 and len(lines) == 1 and "no dead letter 1-0" in lines[0], lines
        return
    if path == HEALTHCHECK:
        assert code == 1, lines
        refused = f"cannot reach PostgreSQL at 127.0.0.1:{port}/prod: connection refused"
        assert lines[0] == f"fail  postgres: {refused}"
        assert not any(PASSWORD in line for line in lines), lines
        return
    # Besides notes of what was chosen before PostgreSQL was asked (standalone's web UI port
    # when 8080 is taken by another process), one line.
    said = [line for line in lines if not line.startswith("note: ")]
    assert (code, said) == (
        2,
        [f"error: cannot reach PostgreSQL at 127.0.0.1:{port}/prod: connection refused"],
    )


@pytest.mark.parametrize("path", COMMANDS, ids=" ".join)
def test_without_redis_the_commands_that_need_it_say_so_in_one_line(
    path: tuple[str, ...],
    files: Path,
    database_url: str,
    sessions: sessionmaker[Session],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    port = free_port()
    monkeypatch.setenv("DEFERRAL_DATABASE_URL", database_url)
    monkeypatch.setenv("DEFERRAL_REDIS_URL", f"redis://:{PASSWORD}@127.0.0.1:{port}/0")
    code, lines = _invoke(_arguments(path, files))
    if path == HEALTHCHECK:
        assert code == 1, lines
        assert f"fail  redis: cannot reach Redis at 127.0.0.1:{port}: connection refused" in lines
        assert not any(PASSWORD in line for line in lines), lines
    elif path in NEEDS_REDIS:
        # Besides notes of what was chosen before Redis was asked (standalone's port when 8080
        # is taken by another process), one line.
        said = [line for line in lines if not line.startswith("note: ")]
        assert (code, said) == (
            2,
            [f"error: cannot reach Redis at 127.0.0.1:{port}: connection refused"],
        )
    else:
        assert not any("Redis" in line or PASSWORD in line for line in lines), lines


def test_the_installed_command_prints_no_traceback(files: Path) -> None:
    port = free_port()
    env = {
        **os.environ,
        "DEFERRAL_DATABASE_URL": f"postgresql+psycopg://deferral:{PASSWORD}@127.0.0.1:{port}/prod",
        "DEFERRAL_REDIS_URL": REDIS_URL,
    }
    done = subprocess.run(
        [sys.executable, "-m", "deferral", "runs", "list"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert done.stdout == ""
    assert done.stderr == (
        f"error: cannot reach PostgreSQL at 127.0.0.1:{port}/prod: connection refused\n"
    )
