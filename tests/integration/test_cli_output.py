"""The `deferral` command in the hand: -h and --version everywhere, every listing as a table or
JSON, `workers list`, `xcom list|get`, `db upgrade` saying what it applied, and
`dags trigger --wait` giving up with exit 3."""

from __future__ import annotations

import datetime as dt
import json
import uuid
from collections.abc import Callable, Iterator
from importlib.metadata import version
from pathlib import Path
from typing import Any

import click
import pytest
from click.testing import CliRunner
from sqlalchemy import create_engine, delete, text, update
from sqlalchemy.engine import URL, make_url
from sqlalchemy.orm import Session, sessionmaker

from broker.client import Broker
from deferral import signals
from deferral.runtime import serialization
from deferral.runtime.config import Settings
from deferral.runtime.crypto import Cipher
from deferral.store import xcom
from deferral.store.db import url_location
from deferral.store.tables import AssetModel, TaskInstance, Triggerer, Worker
from deferral_cli import main as deferral_main
from scheduler.cli import main as scheduler_main
from tests.conftest import ADMIN_URL, drop_database_later
from tests.integration.cli_tree import command_at, walk
from tests.integration.conftest import CLI_DAG_SOURCE
from tests.integration.factories import (
    DAG_ID,
    WORKER,
    awaiting_input_task,
    deferred_task,
    running_task,
)
from tests.parsed_dags import record_dags_folder
from triggerer.cli import main as triggerer_main
from webserver import tokens, users
from worker.cli import main as worker_main

PROGRAMS = {
    "deferral": deferral_main,
    "scheduler": scheduler_main,
    "worker": worker_main,
    "triggerer": triggerer_main,
}


EVERY_COMMAND = [
    (program, path, command) for program, root in PROGRAMS.items() for path, command in walk(root)
]


def run(*args: str) -> Any:
    return CliRunner().invoke(deferral_main, list(args))


@pytest.mark.parametrize(
    ("program", "path", "command"),
    EVERY_COMMAND,
    ids=[" ".join((program, *path)) for program, path, _ in EVERY_COMMAND],
)
def test_every_command_takes_h_for_help_and_every_group_version(
    program: str, path: tuple[str, ...], command: click.Command
) -> None:
    for flag in ("-h", "--help"):
        result = CliRunner().invoke(PROGRAMS[program], [*path, flag], prog_name=program)
        assert result.exit_code == 0, result.output
        assert result.output.startswith(f"Usage: {' '.join((program, *path))} ")
    if isinstance(command, click.Group):
        result = CliRunner().invoke(PROGRAMS[program], [*path, "--version"], prog_name=program)
        assert result.exit_code == 0, result.output
        assert result.output == f"{program} {version('deferral')}\n"


LISTINGS = {
    ("approvals", "list"),
    ("dags", "list"),
    ("runs", "list"),
    ("tasks", "list"),
    ("triggers", "list"),
    ("triggerers", "list"),
    ("workers", "list"),
    ("xcom", "list"),
    ("variables", "list"),
    ("connections", "list"),
    ("users", "list"),
    ("streams",),
    ("doctor",),
    ("dead", "list"),
    ("assets", "list"),
    ("signals", "list"),
    ("tokens", "list"),
}


def test_every_listing_and_only_those_take_output_and_json() -> None:
    with_output = {
        path
        for _, path, command in EVERY_COMMAND
        if any(param.name == "output" for param in command.params)
    }
    listings = {path for _, path, _ in EVERY_COMMAND if path[-1:] == ("list",)}
    assert listings <= LISTINGS
    assert with_output == LISTINGS
    for path in LISTINGS:
        options = {opt for param in command_at(deferral_main, path).params for opt in param.opts}
        assert {"-o", "--output", "--json"} <= options, path


@pytest.fixture
def everything(
    settings: Settings,
    sessions: sessionmaker[Session],
    cipher: Cipher,
    broker: Broker,
    write_dag: Callable[[str, str], Path],
) -> int:
    """One of every thing a listing shows: a DAG, a deferred task and its trigger, a running task
    with XComs, a triggerer, a worker, a variable, a connection, a dead letter, an asset, a
    signal, an API token; returns the running task's id."""
    write_dag(f"listed_{uuid.uuid4().hex[:8]}", CLI_DAG_SOURCE.format(dag_id="listed"))
    record_dags_folder(settings)
    deferred_task(sessions, cipher, task_id="waits", run_id="r1")
    ti_id = running_task(sessions, task_id="pushes", run_id="r2")
    awaiting_input_task(sessions, task_id="asks", run_id="r3")
    with sessions.begin() as session:
        xcom.upsert(session, ti_id, "return_value", serialization.to_jsonable({"n": 1}))
        # Its heartbeat stays fresh however long a loaded machine takes over the listings:
        # `doctor` is run twice and must answer the same both times.
        fresh = dt.datetime.now(dt.UTC) + dt.timedelta(hours=1)
        session.add(
            Triggerer(
                name="t1",
                hostname="h",
                pid=1,
                capacity=10,
                state="running",
                latest_heartbeat=fresh,
            )
        )
        session.add(AssetModel(name="orders", uri="s3://bucket/orders"))
        signals.send_in(session, cipher, "orders-paid", {"order": 1})
        session.add(
            Worker(
                name=WORKER, hostname="h", pid=2, queue="default", concurrency=4, state="running"
            )
        )
    for args in (
        ("variables", "set", "greeting", "hello"),
        ("connections", "add", "db", "--conn-uri", "postgres://app:pa55word@db.example:5432/x"),
    ):
        assert run(*args).exit_code == 0
    broker.publish(broker.keys.dead, {"error": "boom"})
    with sessions.begin() as session:
        users.create_user(session, "ann", "ann-password-1")
        tokens.create_token(session, cipher, "bot", [tokens.SIGNALS])
    return ti_id


def _listing_holds(path: tuple[str, ...]) -> None:
    args = [*path, DAG_ID, "r2"] if path == ("xcom", "list") else list(path)
    as_json, as_output = run(*args, "--json"), run(*args, "-o", "json")
    assert as_json.exit_code == as_output.exit_code
    assert as_json.exit_code in (0, 1), as_json.output  # doctor fails a check here
    records = json.loads(as_json.stdout)
    assert [list(r) for r in records] == [list(r) for r in json.loads(as_output.stdout)]
    assert records and all(isinstance(record, dict) for record in records)
    if path != ("doctor",):  # whose text form is its checklist
        table = run(*args)
        assert table.stdout.splitlines()[0].split() == [key.upper() for key in records[0]]


def test_each_listing_prints_a_json_array_of_objects(everything: int) -> None:
    # One test over every listing: they read the same rows, made once (a user among them,
    # whose password hash is slow by design).
    failed = {}
    for path in sorted(LISTINGS):
        try:
            _listing_holds(path)
        except (AssertionError, ValueError) as error:
            failed[" ".join(path)] = f"{type(error).__name__}: {error}"
    assert failed == {}


def test_runs_and_tasks_as_json_keep_their_types(everything: int) -> None:
    (run_r1,) = [r for r in json.loads(run("runs", "list", "--json").stdout) if r["run_id"] == "r1"]
    assert run_r1["dag_id"] == DAG_ID and run_r1["state"] == "running"
    assert dt.datetime.fromisoformat(run_r1["logical_date"]).tzinfo is not None
    assert run_r1["end_date"] is None
    tasks = {t["task_id"]: t for t in json.loads(run("tasks", "list", "--json").stdout)}
    assert tasks["waits"]["state"] == "deferred" and isinstance(tasks["waits"]["trigger_id"], int)
    assert tasks["pushes"]["try_number"] == 1 and tasks["pushes"]["trigger_id"] is None


def test_connections_list_never_shows_a_password(everything: int) -> None:
    for args in (("connections", "list"), ("connections", "list", "--json")):
        result = run(*args)
        assert result.exit_code == 0
        assert "pa55word" not in result.output
    (conn,) = json.loads(run("connections", "list", "--json").stdout)
    assert conn["password"] == "***" and conn["host"] == "db.example" and conn["port"] == 5432


def test_workers_list_tells_alive_from_stale(
    settings: Settings, sessions: sessionmaker[Session], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DEFERRAL_HEARTBEAT_SEC", "10")  # stale after 21 s
    with sessions.begin() as session:
        session.add(
            Worker(name="w-fresh", hostname="h1", pid=1, queue="q", concurrency=4, state="running")
        )
        session.add(
            Worker(
                name="w-old",
                hostname="h2",
                pid=2,
                queue="default",
                concurrency=2,
                load=1,
                state="running",
                latest_heartbeat=dt.datetime.now(dt.UTC) - dt.timedelta(minutes=1),
            )
        )
        session.add(
            Worker(
                name="w-stopped", hostname="h3", pid=3, queue="q", concurrency=1, state="stopped"
            )
        )
    workers = {w["name"]: w for w in json.loads(run("workers", "list", "--json").stdout)}
    assert {name: w["health"] for name, w in workers.items()} == {
        "w-fresh": "alive",
        "w-old": "stale",
        "w-stopped": "stopped",
    }
    assert workers["w-old"]["queue"] == "default" and workers["w-old"]["load"] == 1
    assert 30 < workers["w-old"]["heartbeat_age_sec"] < 120
    table = run("workers", "list").stdout.splitlines()
    assert table[0].split() == [
        "NAME",
        "HOSTNAME",
        "PID",
        "STATE",
        "QUEUE",
        "LOAD",
        "CONCURRENCY",
        "LATEST_HEARTBEAT",
        "HEARTBEAT_AGE_SEC",
        "HEALTH",
    ]
    with sessions.begin() as session:
        session.execute(delete(Worker))
    assert run("workers", "list").stdout == "no workers\n"


def test_explain_says_whether_the_worker_of_a_task_is_alive(
    settings: Settings, sessions: sessionmaker[Session], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DEFERRAL_HEARTBEAT_SEC", "10")
    running_task(sessions, task_id="t", run_id="r1")
    lines = run("tasks", "explain", DAG_ID, "r1", "t").stdout.splitlines()
    assert f"  worker {WORKER} is not registered" in lines
    with sessions.begin() as session:
        session.add(
            Worker(
                name=WORKER, hostname="h", pid=1, queue="default", concurrency=1, state="running"
            )
        )
    lines = run("tasks", "explain", DAG_ID, "r1", "t").stdout.splitlines()
    (said,) = [line for line in lines if line.startswith(f"  worker {WORKER} (running), heartb")]
    assert said.endswith(": alive"), lines
    with sessions.begin() as session:
        session.execute(
            update(Worker).values(latest_heartbeat=dt.datetime.now(dt.UTC) - dt.timedelta(hours=1))
        )
    text = run("tasks", "explain", DAG_ID, "r1", "t").stdout
    assert ": stale; the attempt is failed (and retried if a try is left)" in text


def test_explain_a_queued_task_counts_the_alive_workers_of_its_queue(
    settings: Settings, sessions: sessionmaker[Session], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DEFERRAL_HEARTBEAT_SEC", "10")
    ti_id = running_task(sessions, task_id="t", run_id="r1")
    with sessions.begin() as session:
        session.execute(update(TaskInstance).where(TaskInstance.id == ti_id).values(state="queued"))
    lines = run("tasks", "explain", DAG_ID, "r1", "t").stdout.splitlines()
    assert (
        "  no worker reading queue default is alive: start `worker consume --queue default`"
        in lines
    )
    with sessions.begin() as session:
        session.add(
            Worker(name="w1", hostname="h", pid=1, queue="default", concurrency=1, state="running")
        )
    lines = run("tasks", "explain", DAG_ID, "r1", "t").stdout.splitlines()
    assert "  1 alive worker(s) read queue default: w1" in lines


# -- xcom ------------------------------------------------------------------------------------------


@pytest.fixture
def pushed(settings: Settings, sessions: sessionmaker[Session]) -> dict[str, int]:
    """Two task instances of run r1 (one mapped) with XComs of every kind of value."""
    first = running_task(sessions, task_id="first", run_id="r1")
    with sessions.begin() as session:
        session.add(
            TaskInstance(
                dag_id=DAG_ID,
                run_id="r1",
                task_id="mapped",
                map_index=3,
                state="success",
                try_number=1,
                pool="default_pool",
                queue="default",
            )
        )
    with sessions() as session:
        mapped = session.query(TaskInstance.id).filter_by(task_id="mapped").scalar()
    moment = dt.datetime(2024, 5, 1, 12, 0, tzinfo=dt.UTC)
    with sessions.begin() as session:
        for ti_id, key, value in [
            (first, "return_value", {"when": moment, "took": dt.timedelta(seconds=90)}),
            (first, "pair", (1, "two")),
            (first, "long", "x" * 200),
            (mapped, "return_value", 3),
        ]:
            xcom.upsert(session, ti_id, key, serialization.to_jsonable(value))
    return {"first": first, "mapped": mapped}


def test_xcom_list_shows_every_value_as_json(pushed: dict[str, int]) -> None:
    records = json.loads(run("xcom", "list", DAG_ID, "r1", "--json").stdout)
    assert [(r["task_id"], r["map_index"], r["key"], r["value"]) for r in records] == [
        ("first", -1, "long", "x" * 200),
        ("first", -1, "pair", [1, "two"]),
        ("first", -1, "return_value", {"when": "2024-05-01T12:00:00+00:00", "took": 90.0}),
        ("mapped", 3, "return_value", 3),
    ]
    table = run("xcom", "list", DAG_ID, "r1", "first").stdout.splitlines()
    assert table[0].split() == ["TASK_ID", "MAP_INDEX", "KEY", "VALUE", "CREATED_AT"]
    assert len(table) == 4 and "mapped" not in "\n".join(table)
    long_row = table[1].split()
    assert long_row[3] == '"' + "x" * 56 + "..."  # cut in the table, whole in JSON
    assert run("xcom", "list", DAG_ID, "r1", "nobody").stdout == "no XComs\n"


def test_xcom_get_prints_one_value_as_json(pushed: dict[str, int]) -> None:
    got = run("xcom", "get", DAG_ID, "r1", "first")
    assert got.exit_code == 0, got.output
    assert json.loads(got.stdout) == {"when": "2024-05-01T12:00:00+00:00", "took": 90.0}
    assert json.loads(run("xcom", "get", DAG_ID, "r1", "first", "--key", "pair").stdout) == [
        1,
        "two",
    ]
    mapped = run("xcom", "get", DAG_ID, "r1", "mapped", "--map-index", "3")
    assert mapped.exit_code == 0 and mapped.stdout == "3\n"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("get", DAG_ID, "r9", "first"), f"error: DAG '{DAG_ID}' has no run 'r9'"),
        (("list", DAG_ID, "r9"), f"error: DAG '{DAG_ID}' has no run 'r9'"),
        (
            ("get", DAG_ID, "r1", "nope"),
            f"error: run 'r1' of DAG '{DAG_ID}' has no task instance {DAG_ID}.r1.nope",
        ),
        (
            ("get", DAG_ID, "r1", "mapped"),
            f"error: run 'r1' of DAG '{DAG_ID}' has no task instance {DAG_ID}.r1.mapped",
        ),
        (("get", DAG_ID, "r1", "first", "--key", "k"), f"error: {DAG_ID}.r1.first has no XCom 'k'"),
    ],
)
def test_xcom_names_what_is_missing_in_one_line(
    pushed: dict[str, int], args: tuple[str, ...], message: str
) -> None:
    result = run("xcom", *args)
    assert (result.exit_code, result.output) == (1, message + "\n")


# -- db upgrade ------------------------------------------------------------------------------------


@pytest.fixture
def empty_database(settings: Settings, monkeypatch: pytest.MonkeyPatch) -> Iterator[URL]:
    """A database of its own, without any table, that DEFERRAL_DATABASE_URL names."""
    name = f"deferral_empty_{uuid.uuid4().hex[:8]}"
    admin = create_engine(ADMIN_URL, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    url = make_url(ADMIN_URL).set(database=name)
    monkeypatch.setenv("DEFERRAL_DATABASE_URL", url.render_as_string(hide_password=False))
    yield url
    admin.dispose()
    drop_database_later(name)


def test_db_upgrade_says_what_it_applied(empty_database: URL) -> None:
    before = run("db", "check")
    assert before.exit_code == 1
    assert before.output.startswith("error: database (at no revision) lacks migration(s) 0001")
    applied = run("db", "upgrade")
    assert applied.exit_code == 0, applied.output
    revisions = applied.output.strip().removeprefix("applied ").split(", ")
    assert revisions[0] == "0001" and revisions == sorted(revisions), applied.output
    head = revisions[-1]
    again = run("db", "upgrade")
    assert (again.exit_code, again.output) == (0, f"already at {head}: nothing to apply\n")
    assert run("db", "check").output == f"database is up to date (at {head})\n"


def test_a_database_without_the_schema_says_to_upgrade(empty_database: URL) -> None:
    result = run("runs", "list")
    assert result.exit_code == 1
    assert result.output == (
        f"error: PostgreSQL at {url_location(empty_database)} lacks deferral's tables"
        " (or some of them): run `deferral db upgrade`\n"
    )


# -- dags trigger --wait ---------------------------------------------------------------------------


def test_trigger_wait_gives_up_after_the_timeout_with_exit_3(
    settings: Settings, sessions: sessionmaker[Session], cli_dag: str
) -> None:
    dag_id = cli_dag
    # No scheduler runs here: the run stays queued.
    result = run("dags", "trigger", dag_id, "--run-id", "r1", "--wait", "--timeout", "0.6")
    assert result.exit_code == 3, result.output
    lines = result.output.splitlines()
    assert lines[0] == f"triggered {dag_id} r1"
    assert lines[1].endswith(" run: queued")
    assert lines[-1] == (
        f"error: run r1 of DAG {dag_id} not finished after 0.6s; it goes on"
        f" (`deferral runs show {dag_id} r1`)"
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--timeout", "5"], "Invalid value for --timeout: only means something with --wait"),
        (["--wait", "--timeout", "0"], "Invalid value for '--timeout'"),
    ],
)
def test_trigger_refuses_a_bad_timeout_naming_the_option(
    settings: Settings,
    sessions: sessionmaker[Session],
    cli_dag: str,
    args: list[str],
    message: str,
) -> None:
    result = run("dags", "trigger", cli_dag, *args)
    assert result.exit_code == 2
    assert message in result.output
