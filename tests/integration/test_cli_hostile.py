"""Hostile text in ids and values meets the ``deferral`` command: control characters are refused
in the ids of a run triggered from the CLI, escaped in everything printed from the database, and
exported secrets land in a file only its owner can read."""

from __future__ import annotations

import datetime as dt
import json
import os
import stat
from pathlib import Path

import pytest
from click.testing import CliRunner
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from deferral import variables
from deferral.runtime import serialization
from deferral.runtime.config import Settings
from deferral.runtime.crypto import Cipher
from deferral.store import tasklogs, xcom
from deferral.store.tables import DagRun
from deferral_cli import main as deferral_main
from tests.integration.factories import DAG_ID, running_task

# A terminal told to retitle its window, clear the screen and move the cursor; a one-byte CSI.
ESCAPES = "\x1b]0;pwned\x07\x1b[2J\x1b[H\x9b31m\r"


def _run(*args: str) -> tuple[int, str, str]:
    # color=True: as on a terminal, where click leaves ANSI sequences in what it prints.
    result = CliRunner().invoke(deferral_main, list(args), color=True)
    return result.exit_code, result.stdout, result.stderr


@pytest.mark.parametrize(
    ("args", "fault"),
    [
        (["--run-id", "r1\n2026-01-01 00:00:00,000 ERROR forged"], "--run-id"),
        (["--run-id", "r1\x00"], "--run-id"),
        (["--run-id", "r\x1b[2J"], "--run-id"),
        (["--conf", '{"k\\u0007ey": 1}'], "--conf"),
        (["--conf", '{"k": "v\\u0000"}'], "--conf"),
    ],
    ids=["newline", "nul", "escape", "control-in-conf-key", "nul-in-conf-value"],
)
def test_dags_trigger_refuses_control_characters_in_one_line(
    settings: Settings, sessions: sessionmaker[Session], cli_dag: str, args: list[str], fault: str
) -> None:
    code, out, err = _run("dags", "trigger", cli_dag, *args)
    assert code == 2, (out, err)
    said = [line for line in err.splitlines() if line.startswith("Error:")]
    assert len(said) == 1 and fault in said[0], err
    assert "control character" in said[0] or "NUL character" in said[0]
    assert all(ord(c) >= 0x20 for c in said[0])
    with sessions() as session:
        assert session.scalars(select(DagRun)).all() == []


def test_dags_trigger_refuses_a_dag_id_with_a_control_character(settings: Settings) -> None:
    code, _, err = _run("dags", "trigger", "d\x1b[2Jag")
    assert code == 2 and "DAG_ID" in err and r"\x1b" in err and "\x1b" not in err


def test_a_task_log_line_with_terminal_escapes_is_shown_escaped(
    settings: Settings, sessions: sessionmaker[Session]
) -> None:
    ti_id = running_task(sessions, task_id="noisy", run_id="r1")
    at = dt.datetime(2024, 5, 1, 12, 0, tzinfo=dt.UTC)
    with sessions.begin() as session:
        line = tasklogs.NewLine(ti_id, 1, at, "task", f"before{ESCAPES}after")
        tasklogs.append(session, [line], 10_000)
    code, out, _ = _run("tasks", "logs", DAG_ID, "r1", "noisy")
    assert code == 0, out
    assert r"before\x1b]0;pwned\x07\x1b[2J\x1b[H\x9b31m\x0dafter" in out
    assert all(c in "\n\t" or (0x20 <= ord(c) < 0x7F or ord(c) > 0x9F) for c in out)


def test_ids_and_xcom_values_with_escapes_are_shown_escaped(
    settings: Settings, sessions: sessionmaker[Session]
) -> None:
    ti_id = running_task(sessions, task_id="t\x1b[31m", run_id="r\x1b[2J")
    with sessions.begin() as session:
        xcom.upsert(session, ti_id, "return_value", serialization.to_jsonable(f"v{ESCAPES}"))
    for args in (
        ["runs", "show", DAG_ID, "r\x1b[2J"],
        ["tasks", "list"],
        ["xcom", "list", DAG_ID, "r\x1b[2J"],
        ["xcom", "get", DAG_ID, "r\x1b[2J", "t\x1b[31m"],
        ["xcom", "get", DAG_ID, "r\x1b[2J", "t\x1b[31m", "--key", "missing\x1b[2J"],
    ):
        _, out, err = _run(*args)
        assert "\x1b" not in out + err and "\x9b" not in out + err, args
        assert r"\x1b" in out + err or r"\u001b" in out + err, (args, out, err)


def test_variables_export_creates_a_file_only_its_owner_reads(
    settings: Settings, sessions: sessionmaker[Session], cipher: Cipher, tmp_path: Path
) -> None:
    with sessions.begin() as session:
        variables.write_stored(session, cipher, "db_password", "exp0rted-s3cret")
    folder = tmp_path / "exports"
    folder.mkdir()
    fresh, reused = folder / "fresh.json", folder / "reused.json"
    reused.write_text("{}")
    reused.chmod(0o644)  # a file others could read is not written into
    old_umask = os.umask(0)  # the most permissive umask: the mode must not depend on it
    try:
        for target in (fresh, reused):
            code, out, err = _run("variables", "export", str(target))
            assert code == 0, (out, err)
            assert stat.S_IMODE(target.stat().st_mode) == 0o600
            assert json.loads(target.read_text()) == {"db_password": "exp0rted-s3cret"}
    finally:
        os.umask(old_umask)
    assert sorted(p.name for p in folder.iterdir()) == ["fresh.json", "reused.json"]  # no leftover
