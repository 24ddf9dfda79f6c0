"""The `deferral` command line against the test database; bad input gets one clear line."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from pathlib import Path

import pytest
from click.testing import CliRunner
from sqlalchemy import create_engine, select, text
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session, sessionmaker

from deferral.cli import main as deferral_main
from deferral.config import Settings
from deferral.models import DagRun
from scheduler.cli import main as scheduler_main
from tests.conftest import ADMIN_URL
from triggerer.cli import main as triggerer_main
from worker.cli import main as worker_main

DAG_SOURCE = """
from deferral import DAG
from deferral.operators import EmptyOperator

with DAG("{dag_id}") as dag:
    EmptyOperator(task_id="a") >> EmptyOperator(task_id="b")
"""


@pytest.fixture
def dag_id(write_dag: Callable[[str, str], Path]) -> str:
    dag_id = f"cli_{uuid.uuid4().hex[:8]}"
    write_dag(dag_id, DAG_SOURCE.format(dag_id=dag_id))
    return dag_id


@pytest.mark.parametrize(
    ("command", "args"),
    [
        (deferral_main, []),
        (deferral_main, ["db", "upgrade"]),
        (deferral_main, ["db", "check"]),
        (deferral_main, ["dags", "list"]),
        (deferral_main, ["dags", "trigger"]),
        (deferral_main, ["runs", "show"]),
        (deferral_main, ["standalone"]),
        (triggerer_main, ["consume"]),
        (scheduler_main, ["consume"]),
        (worker_main, ["consume"]),
    ],
)
def test_every_command_has_help(command: object, args: list[str]) -> None:
    result = CliRunner().invoke(command, [*args, "--help"])  # type: ignore[arg-type]
    assert result.exit_code == 0, result.output
    assert "Usage:" in result.output


def test_dags_list_shows_dags_and_import_errors(
    settings: Settings, dag_id: str, write_dag: Callable[[str, str], Path]
) -> None:
    result = CliRunner().invoke(deferral_main, ["dags", "list"])
    assert result.exit_code == 0 and dag_id in result.output

    write_dag(f"broken_{uuid.uuid4().hex[:8]}", "raise RuntimeError('boom')\n")
    result = CliRunner().invoke(deferral_main, ["dags", "list"])
    assert result.exit_code == 1
    assert dag_id in result.output
    assert "RuntimeError: boom (line 1)" in result.output


def test_trigger_creates_a_queued_run_with_its_conf(
    settings: Settings, sessions: sessionmaker[Session], dag_id: str
) -> None:
    result = CliRunner().invoke(
        deferral_main, ["dags", "trigger", dag_id, "--conf", '{"x": 1}', "--run-id", "r1"]
    )
    assert result.exit_code == 0, result.output
    with sessions() as session:
        run = session.scalars(select(DagRun)).one()
    assert (run.dag_id, run.run_id, run.state, run.conf) == (dag_id, "r1", "queued", {"x": 1})

    again = CliRunner().invoke(deferral_main, ["dags", "trigger", dag_id, "--run-id", "r1"])
    assert again.exit_code == 1
    assert f"error: DAG '{dag_id}' already has a run 'r1'" in again.output


@pytest.mark.parametrize(
    ("conf", "message"),
    [("{not json", "not valid JSON"), ("[1, 2]", "must be a JSON object")],
)
def test_trigger_refuses_bad_conf_naming_the_option(
    settings: Settings, sessions: sessionmaker[Session], dag_id: str, conf: str, message: str
) -> None:
    result = CliRunner().invoke(deferral_main, ["dags", "trigger", dag_id, "--conf", conf])
    assert result.exit_code == 2
    assert "--conf" in result.output and message in result.output
    with sessions() as session:
        assert session.scalars(select(DagRun)).all() == []


def test_trigger_of_an_unknown_dag_names_it(
    settings: Settings, sessions: sessionmaker[Session]
) -> None:
    result = CliRunner().invoke(deferral_main, ["dags", "trigger", "no_such_dag"])
    assert result.exit_code == 1
    assert "error: DAG 'no_such_dag' not found" in result.output


def test_runs_show_lists_task_instances_and_refuses_unknown_runs(
    settings: Settings, sessions: sessionmaker[Session], dag_id: str
) -> None:
    CliRunner().invoke(deferral_main, ["dags", "trigger", dag_id, "--run-id", "r1"])
    shown = CliRunner().invoke(deferral_main, ["runs", "show", dag_id, "r1", "--history"])
    assert shown.exit_code == 0 and f"{dag_id} r1: queued" in shown.output

    missing = CliRunner().invoke(deferral_main, ["runs", "show", dag_id, "nope"])
    assert missing.exit_code == 1
    assert f"error: DAG '{dag_id}' has no run 'nope'" in missing.output


def test_db_check_names_missing_migrations_and_upgrade_applies_them(
    settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    name = f"deferral_empty_{uuid.uuid4().hex[:8]}"
    admin = create_engine(ADMIN_URL, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    try:
        url = make_url(ADMIN_URL).set(database=name).render_as_string(hide_password=False)
        monkeypatch.setenv("DEFERRAL_DATABASE_URL", url)
        check = CliRunner().invoke(deferral_main, ["db", "check"])
        assert check.exit_code == 1
        assert "lacks migration(s) 0001" in check.output
        assert CliRunner().invoke(deferral_main, ["db", "upgrade"]).exit_code == 0
        assert CliRunner().invoke(deferral_main, ["db", "check"]).exit_code == 0
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


def test_worker_refuses_a_bad_queue_name(settings: Settings) -> None:
    result = CliRunner().invoke(worker_main, ["consume", "--queue", "bad queue!"])
    assert result.exit_code == 2
    assert "--queue" in result.output and "invalid" in result.output
