"""The `deferral` command line against the test database; bad input gets one clear line."""

from __future__ import annotations

import datetime as dt
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest
from click.testing import CliRunner
from sqlalchemy import create_engine, select, text
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session, sessionmaker

from broker.client import Broker
from broker.streams import GROUP_TRIGGERERS, GROUP_WORKERS
from deferral.cli import main as deferral_main
from deferral.config import Settings
from deferral.crypto import Cipher
from deferral.models import DagRun, Trigger, Triggerer
from scheduler.cli import main as scheduler_main
from tests.conftest import ADMIN_URL
from tests.integration.factories import DAG_ID, deferred_task, running_task
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
        (deferral_main, ["tasks", "list"]),
        (deferral_main, ["tasks", "clear"]),
        (deferral_main, ["tasks", "mark"]),
        (deferral_main, ["triggers", "list"]),
        (deferral_main, ["triggerers", "list"]),
        (deferral_main, ["streams"]),
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


def _line_with(output: str, *words: str) -> list[str]:
    """The one output line holding every word, split into its columns."""
    lines = [line.split() for line in output.splitlines()]
    matches = [cols for cols in lines if all(word in cols for word in words)]
    assert len(matches) == 1, output
    return matches[0]


def test_tasks_list_shows_deferred_tasks_with_their_trigger_newest_first(
    settings: Settings, sessions: sessionmaker[Session], cipher: Cipher
) -> None:
    running_task(sessions, task_id="busy", run_id="r1")
    timeout = dt.datetime(2031, 1, 2, 3, 4, 5, tzinfo=dt.UTC)
    _, trigger_id = deferred_task(
        sessions, cipher, task_id="waiting", run_id="r2", trigger_timeout=timeout
    )

    listed = CliRunner().invoke(deferral_main, ["tasks", "list"])
    assert listed.exit_code == 0, listed.output
    header, newest, oldest = listed.output.splitlines()
    assert header.split()[:5] == ["DAG_ID", "RUN_ID", "TASK_ID", "STATE", "TRY"]
    assert newest.split() == [
        DAG_ID,
        "r2",
        "waiting",
        "deferred",
        "1",
        str(trigger_id),
        "2031-01-02T03:04:05+00:00",
    ]
    assert oldest.split() == [DAG_ID, "r1", "busy", "running", "1", "-", "-"]

    deferred = CliRunner().invoke(deferral_main, ["tasks", "list", "--state", "deferred"])
    assert deferred.exit_code == 0, deferred.output
    assert "waiting" in deferred.output and "busy" not in deferred.output

    other_dag = CliRunner().invoke(deferral_main, ["tasks", "list", "--dag-id", "other"])
    assert other_dag.exit_code == 0 and other_dag.output == "no task instances\n"


def test_tasks_list_refuses_an_unknown_state_naming_the_option(settings: Settings) -> None:
    result = CliRunner().invoke(deferral_main, ["tasks", "list", "--state", "bogus"])
    assert result.exit_code == 2
    assert "--state" in result.output and "'bogus' is not one of" in result.output


def test_triggers_list_shows_the_waiting_task_but_never_the_kwargs(
    settings: Settings, sessions: sessionmaker[Session], cipher: Cipher
) -> None:
    _, trigger_id = deferred_task(sessions, cipher, task_id="waiting", run_id="r1")
    with sessions() as session:
        token = session.get_one(Trigger, trigger_id).kwargs

    listed = CliRunner().invoke(deferral_main, ["triggers", "list"])
    assert listed.exit_code == 0, listed.output
    row = _line_with(listed.output, str(trigger_id))
    assert row[1] == "deferral.triggers.temporal.DateTimeTrigger"
    assert row[2] == "-"  # no triggerer has taken it yet
    assert row[-1] == f"{DAG_ID}.r1.waiting"
    assert token not in listed.output and "moment" not in listed.output


def test_triggerers_list_tells_alive_from_stale(
    settings: Settings, sessions: sessionmaker[Session], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DEFERRAL_HEARTBEAT_SEC", "10")  # stale after 21 s: slack for slow hosts
    long_ago = dt.datetime.now(dt.UTC) - dt.timedelta(seconds=60)
    with sessions.begin() as session:
        session.add(
            Triggerer(name="fresh", hostname="h1", pid=11, capacity=100, load=3, state="running")
        )
        session.add(
            Triggerer(
                name="old",
                hostname="h2",
                pid=22,
                capacity=50,
                load=0,
                state="running",
                latest_heartbeat=long_ago,
            )
        )

    listed = CliRunner().invoke(deferral_main, ["triggerers", "list"])
    assert listed.exit_code == 0, listed.output
    fresh = _line_with(listed.output, "fresh")
    assert fresh[1:5] == ["h1", "11", "running", "3/100"] and fresh[-1] == "alive"
    old = _line_with(listed.output, "old")
    assert old[4] == "0/50" and old[-1] == "stale"
    assert 30 < float(old[-2].rstrip("s")) < 120  # about 60 s, give or take clock skew


def test_streams_shows_lengths_pending_per_consumer_and_lag(
    settings: Settings, broker: Broker
) -> None:
    triggers, queue = broker.keys.triggers, broker.keys.queue("default")
    broker.ensure_group(triggers, GROUP_TRIGGERERS)
    for n in range(4):
        broker.publish(triggers, {"n": str(n)})
    broker.read(GROUP_TRIGGERERS, "t1", {triggers: ">"}, count=2)
    broker.read(GROUP_TRIGGERERS, "t2", {triggers: ">"}, count=1)
    broker.ensure_group(queue, GROUP_WORKERS)
    broker.publish(queue, {"n": "0"})
    broker.publish(broker.keys.dead, {"error": "boom"})

    shown = CliRunner().invoke(deferral_main, ["streams"])
    assert shown.exit_code == 0, shown.output
    version = broker.redis.info("server")["redis_version"]
    lag = "1" if int(str(version).split(".")[0]) >= 7 else "-"  # XINFO GROUPS has lag from 7
    assert _line_with(shown.output, triggers) == [
        triggers,
        "4",
        GROUP_TRIGGERERS,
        "3",
        lag,
        "t1=2",
        "t2=1",
    ]
    assert _line_with(shown.output, queue) == [queue, "1", GROUP_WORKERS, "0", lag, "-"]
    assert _line_with(shown.output, broker.keys.dead) == [broker.keys.dead, "1", "-", "-", "-", "-"]
    assert _line_with(shown.output, broker.keys.events)[1] == "missing"
