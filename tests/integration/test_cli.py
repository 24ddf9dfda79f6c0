"""The `deferral` command line against the test database; bad input gets one clear line."""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest
from click.testing import CliRunner
from cryptography.fernet import Fernet, InvalidToken
from sqlalchemy import create_engine, select, text, update
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session, sessionmaker

from broker.client import Broker
from broker.streams import GROUP_TRIGGERERS, GROUP_WORKERS
from deferral.runtime import serialization
from deferral.runtime.config import Settings
from deferral.runtime.crypto import Cipher, DecryptionError, Purpose
from deferral.states import TaskState
from deferral.store import progress, transitions
from deferral.store.tables import (
    Dag,
    DagImportError,
    DagRun,
    Outbox,
    TaskInstance,
    Trigger,
    Triggerer,
)
from deferral.store.transitions import Attempt, NewTaskInstance
from deferral_cli import main as deferral_main
from tests.conftest import ADMIN_URL, drop_database_later
from tests.integration.factories import DAG_ID, WORKER, deferred_task, running_task
from tests.parsed_dags import record_dags_folder
from worker.cli import main as worker_main


@pytest.fixture
def dag_id(cli_dag: str) -> str:
    return cli_dag


def test_dags_list_shows_dags_and_import_errors(
    settings: Settings, dag_id: str, write_dag: Callable[[str, str], Path]
) -> None:
    result = CliRunner().invoke(deferral_main, ["dags", "list"])
    assert result.exit_code == 0 and dag_id in result.output

    write_dag(f"broken_{uuid.uuid4().hex[:8]}", "raise RuntimeError('boom')\n")
    record_dags_folder(settings)
    result = CliRunner().invoke(deferral_main, ["dags", "list"])
    assert result.exit_code == 1
    assert dag_id in result.output
    assert "RuntimeError: boom (line 1)" in result.output


def test_commands_go_on_past_a_dag_file_that_never_finishes_importing(
    settings: Settings,
    dag_id: str,
    write_dag: Callable[[str, str], Path],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("DEFERRAL_DAGBAG_IMPORT_TIMEOUT", "0.5")
    sleeper = write_dag(
        f"sleeps_{uuid.uuid4().hex[:8]}", "import time\nwhile True:\n    time.sleep(1)\n"
    )
    record_dags_folder(dataclasses.replace(settings, dagbag_import_timeout=0.5))
    listed = CliRunner().invoke(deferral_main, ["dags", "list"])
    assert listed.exit_code == 1
    assert dag_id in listed.output
    assert sleeper.name in listed.output
    assert "DagImportTimeout: importing the file took longer than 0.5 s" in listed.output
    triggered = CliRunner().invoke(deferral_main, ["dags", "trigger", dag_id])
    assert triggered.exit_code == 0, triggered.output


def test_dags_list_shows_tags_and_filters_by_them(
    settings: Settings, write_dag: Callable[[str, str], Path]
) -> None:
    suffix = uuid.uuid4().hex[:8]
    for name, tags in (("etl", ["etl", "daily"]), ("ml", ["ml"]), ("bare", None)):
        write_dag(
            f"tagged_{name}_{suffix}",
            f"from deferral import DAG\ndag = DAG('tagged_{name}_{suffix}', tags={tags!r})\n",
        )
    record_dags_folder(settings)
    listed = CliRunner().invoke(deferral_main, ["dags", "list", "--json"])
    assert listed.exit_code == 0, listed.output
    tags_of = {record["dag_id"]: record["tags"] for record in json.loads(listed.output)}
    assert tags_of[f"tagged_etl_{suffix}"] == ["etl", "daily"]
    assert tags_of[f"tagged_bare_{suffix}"] == []
    for option in (["--tags", "daily"], ["--tags", "ml,daily"], ["--tags", "ml", "--tags", "etl"]):
        result = CliRunner().invoke(deferral_main, ["dags", "list", *option])
        assert result.exit_code == 0, result.output
        assert (
            f"tagged_etl_{suffix}" in result.output and f"tagged_bare_{suffix}" not in result.output
        )
        assert "etl,daily" in result.output
    only_ml = CliRunner().invoke(deferral_main, ["dags", "list", "--tags", "ml"])
    assert f"tagged_ml_{suffix}" in only_ml.output and f"tagged_etl_{suffix}" not in only_ml.output


def test_trigger_checks_conf_against_the_dags_params(
    settings: Settings, sessions: sessionmaker[Session], write_dag: Callable[[str, str], Path]
) -> None:
    dag_id = f"params_{uuid.uuid4().hex[:8]}"
    write_dag(
        dag_id,
        "from deferral import DAG\nfrom deferral.models.param import Param\n"
        f"dag = DAG('{dag_id}', params={{'n': Param(1, type='integer', minimum=1),"
        " 'who': Param(type='string')})\n",
    )
    record_dags_folder(settings)
    bad = CliRunner().invoke(deferral_main, ["dags", "trigger", dag_id, "--conf", '{"n": 0}'])
    assert bad.exit_code == 1
    assert "param 'n': 0 is invalid" in bad.output
    missing = CliRunner().invoke(deferral_main, ["dags", "trigger", dag_id])
    assert missing.exit_code == 1 and "param 'who' has no value and no default" in missing.output
    good = CliRunner().invoke(deferral_main, ["dags", "trigger", dag_id, "--conf", '{"who": "x"}'])
    assert good.exit_code == 0, good.output
    with sessions() as session:
        assert [r.conf for r in session.scalars(select(DagRun))] == [{"who": "x"}]


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
        assert "lacks migration(s) 0001, 0002" in check.output
        assert CliRunner().invoke(deferral_main, ["db", "upgrade"]).exit_code == 0
        assert CliRunner().invoke(deferral_main, ["db", "check"]).exit_code == 0
    finally:
        admin.dispose()
        drop_database_later(name)


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
    assert header.split() == [
        "DAG_ID",
        "RUN_ID",
        "TASK_ID",
        "MAP_INDEX",
        "STATE",
        "TRY_NUMBER",
        "TRIGGER_ID",
        "TRIGGER_TIMEOUT",
    ]
    assert newest.split() == [
        DAG_ID,
        "r2",
        "waiting",
        "-1",
        "deferred",
        "1",
        str(trigger_id),
        "2031-01-02T03:04:05+00:00",
    ]
    assert oldest.split() == [DAG_ID, "r1", "busy", "-1", "running", "1", "-", "-"]

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
    assert fresh[1:6] == ["h1", "11", "running", "3", "100"] and fresh[-1] == "alive"
    old = _line_with(listed.output, "old")
    assert old[4:6] == ["0", "50"] and old[-1] == "stale"
    assert 30 < float(old[-2]) < 120  # about 60 s, give or take clock skew


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
        "True",
        "4",
        GROUP_TRIGGERERS,
        "3",
        lag,
        "t1=2",
        "t2=1",
    ]
    assert _line_with(shown.output, queue) == [queue, "True", "1", GROUP_WORKERS, "0", lag, "-"]
    dead = broker.keys.dead
    assert _line_with(shown.output, dead) == [dead, "True", "1", "-", "-", "-", "-"]
    assert _line_with(shown.output, broker.keys.events)[1:3] == ["False", "-"]


# -- doctor ----------------------------------------------------------------------------------------

DOCTOR_CHECKS = {
    "triggerer alive",
    "capacity",
    "trigger queues served",
    "expired timeouts",
    "orphaned triggers",
    "unpublished outbox",
    "broken DAGs",
    "import errors",
    "dead letters",
    "in flight",
}


def _doctor() -> tuple[int, dict[str, tuple[str, str]]]:
    """Run `deferral doctor`; return its exit code and check name -> (status, detail)."""
    result = CliRunner().invoke(deferral_main, ["doctor"])
    checks: dict[str, tuple[str, str]] = {}
    for line in result.output.splitlines():
        status, _, rest = line.partition("  ")
        name, _, detail = rest.partition(": ")
        assert status in ("ok", "warn", "fail"), result.output
        checks[name] = (status, detail)
    assert set(checks) == DOCTOR_CHECKS, result.output
    return result.exit_code, checks


def _add_triggerer(
    sessions: sessionmaker[Session], name: str, *, age_sec: float = 0, capacity: int = 100
) -> None:
    with sessions.begin() as session:
        triggerer = Triggerer(
            name=name, hostname="h", pid=1, capacity=capacity, load=0, state="running"
        )
        if age_sec:
            triggerer.latest_heartbeat = dt.datetime.now(dt.UTC) - dt.timedelta(seconds=age_sec)
        session.add(triggerer)


@pytest.fixture
def slow_heartbeat(settings: Settings, monkeypatch: pytest.MonkeyPatch) -> None:
    """Triggerers stale after 21 s: slack for slow hosts between inserting a row and the check."""
    monkeypatch.setenv("DEFERRAL_HEARTBEAT_SEC", "10")


@pytest.mark.usefixtures("slow_heartbeat")
def test_doctor_is_all_ok_on_a_healthy_system(
    settings: Settings, sessions: sessionmaker[Session], cipher: Cipher, broker: Broker
) -> None:
    _add_triggerer(sessions, "live")
    deferred_task(sessions, cipher, trigger_timeout=dt.datetime.now(dt.UTC) + dt.timedelta(hours=1))

    code, checks = _doctor()
    assert code == 0
    assert {status for status, _ in checks.values()} == {"ok"}, checks
    assert checks["triggerer alive"][1] == "1 triggerer alive: live"
    assert checks["capacity"][1] == "1 deferred task, capacity 100 on 1 alive triggerer"


@pytest.mark.usefixtures("slow_heartbeat")
def test_doctor_fails_deferred_tasks_without_a_live_triggerer(
    settings: Settings, sessions: sessionmaker[Session], cipher: Cipher, broker: Broker
) -> None:
    _add_triggerer(sessions, "old", age_sec=60)
    deferred_task(sessions, cipher)

    code, checks = _doctor()
    assert code == 1
    status, detail = checks["triggerer alive"]
    assert status == "fail"
    assert "1 deferred task but no triggerer is alive (heartbeat within 21s)" in detail
    assert "last heartbeats: old " in detail
    assert checks["capacity"][0] == "warn"


@pytest.mark.usefixtures("slow_heartbeat")
def test_doctor_fails_on_deferrals_long_past_their_timeout(
    settings: Settings, sessions: sessionmaker[Session], cipher: Cipher, broker: Broker
) -> None:
    _add_triggerer(sessions, "live")
    now = dt.datetime.now(dt.UTC)
    deferred_task(sessions, cipher, run_id="r1", trigger_timeout=now - dt.timedelta(seconds=60))
    # Just passed: the scheduler has a few seconds to fail it before it counts.
    deferred_task(sessions, cipher, run_id="r2", trigger_timeout=now - dt.timedelta(seconds=1))

    code, checks = _doctor()
    assert code == 1
    status, detail = checks["expired timeouts"]
    assert status == "fail" and detail.startswith("1 deferred task past trigger_timeout")
    assert checks["triggerer alive"][0] == "ok"


def test_doctor_warns_on_orphaned_triggers_and_fails_on_tasks_without_one(
    settings: Settings, sessions: sessionmaker[Session], cipher: Cipher, broker: Broker
) -> None:
    with sessions.begin() as session:
        orphan = transitions.create_trigger(
            session, "x.Trigger", cipher.seal(Purpose.TRIGGER_KWARGS, {})
        )

    code, checks = _doctor()
    assert code == 0
    assert checks["orphaned triggers"] == ("warn", f"1 trigger no task waits on (id {orphan})")

    ti_id, trigger_id = deferred_task(sessions, cipher, task_id="lost")
    with sessions.begin() as session:
        session.execute(
            update(TaskInstance).where(TaskInstance.id == ti_id).values(trigger_id=None)
        )

    code, checks = _doctor()
    assert code == 1
    status, detail = checks["orphaned triggers"]
    assert status == "fail"
    assert f"1 deferred task without a trigger row ({DAG_ID}.r1.lost)" in detail
    assert f"2 triggers no task waits on (id {orphan}, {trigger_id})" in detail


def test_doctor_fails_on_outbox_rows_left_unpublished(
    settings: Settings, sessions: sessionmaker[Session], broker: Broker
) -> None:
    long_ago = dt.datetime.now(dt.UTC) - dt.timedelta(minutes=5)
    with sessions.begin() as session:
        session.add(Outbox(stream="s", fields={}, created_at=long_ago))
        session.add(Outbox(stream="s", fields={}, created_at=long_ago, published_at=long_ago))
        session.add(Outbox(stream="s", fields={}))  # just written: the relay has time yet

    code, checks = _doctor()
    assert code == 1
    status, detail = checks["unpublished outbox"]
    assert status == "fail" and detail.startswith("1 outbox row unpublished for more than 30s")


def test_doctor_warns_on_dead_letters(
    settings: Settings, sessions: sessionmaker[Session], broker: Broker
) -> None:
    code, checks = _doctor()
    assert checks["dead letters"] == ("ok", f"{broker.keys.dead} is empty")
    assert code == 0

    broker.publish(broker.keys.dead, {"error": "first boom"})
    broker.publish(broker.keys.dead, {"error": "second boom", "deliveries": "1"})

    code, checks = _doctor()
    assert code == 0  # warnings only
    assert checks["dead letters"] == (
        "warn",
        f"2 entries in {broker.keys.dead}; newest error: second boom",
    )


def _age_deferral(sessions: sessionmaker[Session], ti_id: int) -> None:
    """Deferred a minute ago: long enough for its trigger entry to have reached Redis."""
    with sessions.begin() as session:
        session.execute(
            update(TaskInstance)
            .where(TaskInstance.id == ti_id)
            .values(updated_at=dt.datetime.now(dt.UTC) - dt.timedelta(minutes=1))
        )


def test_doctor_fails_on_a_deferred_task_whose_trigger_is_in_no_stream(
    settings: Settings, sessions: sessionmaker[Session], cipher: Cipher, broker: Broker
) -> None:
    waiting, waiting_trigger = deferred_task(sessions, cipher, run_id="r1", task_id="waiting")
    fired, fired_trigger = deferred_task(sessions, cipher, run_id="r2", task_id="fired")
    lost, _ = deferred_task(sessions, cipher, run_id="r3", task_id="lost")
    for ti_id in (waiting, fired, lost):
        _age_deferral(sessions, ti_id)
    broker.publish(broker.keys.triggers, {"trigger_id": str(waiting_trigger)})
    broker.publish(broker.keys.events, {"trigger_id": str(fired_trigger)})

    code, checks = _doctor()
    assert code == 1
    assert checks["in flight"] == (
        "fail",
        f"1 deferred task whose trigger is in no stream ({DAG_ID}.r3.lost): a running scheduler"
        " republishes them within seconds; if this persists, start `scheduler consume`",
    )


def test_doctor_shows_a_dag_that_stopped_loading_and_its_running_runs(
    settings: Settings, sessions: sessionmaker[Session], broker: Broker
) -> None:
    with sessions.begin() as session:
        transitions.create_dag_run(session, "broken", "r1", dt.datetime.now(dt.UTC), {})
        run = session.scalars(select(DagRun)).one()
        transitions.start_dag_run(session, run, [])
        session.add(
            Dag(
                dag_id="broken",
                missing_since=dt.datetime.now(dt.UTC) - dt.timedelta(seconds=10),
                missing_reason="NameError: name 'oops' is not defined (line 4)",
            )
        )
    code, checks = _doctor()
    assert code == 0
    status, detail = checks["broken DAGs"]
    assert status == "warn"
    assert detail.startswith("1 DAG not loading: broken for ")
    assert "(NameError: name 'oops' is not defined (line 4)): 1 running run fail in " in detail


def test_doctor_warns_on_dag_files_that_fail_to_import(
    settings: Settings, sessions: sessionmaker[Session], broker: Broker
) -> None:
    with sessions.begin() as session:
        session.add(DagImportError(filename="dags/etl.py", error="NameError: oops (line 4)"))
    code, checks = _doctor()
    assert code == 0
    assert checks["import errors"] == (
        "warn",
        "1 DAG file failing to import: dags/etl.py (NameError: oops (line 4));"
        " `deferral dags list` shows each error",
    )


# -- tasks explain ---------------------------------------------------------------------------------


def _explain(*args: str) -> tuple[int, list[str]]:
    result = CliRunner().invoke(deferral_main, ["tasks", "explain", *args])
    return result.exit_code, result.output.splitlines()


def _run_of(sessions: sessionmaker[Session], dag_id: str, task_ids: list[str]) -> dict[str, int]:
    """A running DAG run r1 with task instances (state none); task id -> instance id."""
    with sessions.begin() as session:
        transitions.create_dag_run(session, dag_id, "r1", dt.datetime.now(dt.UTC), {})
        run = session.scalars(select(DagRun)).one()
        transitions.start_dag_run(
            session, run, [NewTaskInstance(t, 0, "default_pool", 1, "default", 1) for t in task_ids]
        )
    with sessions() as session:
        return dict(session.execute(select(TaskInstance.task_id, TaskInstance.id)).all())


@pytest.mark.usefixtures("slow_heartbeat")
def test_explain_a_deferred_task_names_its_trigger_triggerer_and_resume_method(
    settings: Settings, sessions: sessionmaker[Session], cipher: Cipher
) -> None:
    timeout = dt.datetime.now(dt.UTC) + dt.timedelta(hours=1)
    _, trigger_id = deferred_task(sessions, cipher, trigger_timeout=timeout)
    _add_triggerer(sessions, "tr-1")
    with sessions.begin() as session:
        session.get_one(Trigger, trigger_id).triggerer_id = "tr-1"

    code, lines = _explain(DAG_ID, "r1", "t")
    assert code == 0, lines
    assert lines[0] == f"{DAG_ID}.r1.t: deferred (try 1 of at most 1)"
    text = "\n".join(lines)
    assert f"  waits on trigger {trigger_id} (deferral.triggers.temporal.DateTimeTrigger)" in lines
    assert "  run by triggerer tr-1 on h (running), heartbeat " in text and ": alive" in text
    assert "  resumes at next_method resume" in lines
    shard = (
        f"{settings.stream_prefix}:triggers, its event will be in {settings.stream_prefix}:events"
    )
    assert f"  its entry is in {shard} (stream shard 0 of 1)" in lines
    assert "s left" in text  # about 3600 s
    assert "not in the DAGs folder" in text  # the factory DAG has no file


def test_explain_a_waiting_task_names_its_upstream_and_their_states(
    settings: Settings, sessions: sessionmaker[Session], dag_id: str
) -> None:
    ids = _run_of(sessions, dag_id, ["a", "b"])
    with sessions.begin() as session:
        transitions.schedule(session, [ids["a"]])
        transitions.dispatch(session, [ids["a"]])
        assert transitions.start_many(session, [(ids["a"], 1)], "host", "w1")

    code, lines = _explain(dag_id, "r1", "b")
    assert code == 0, lines
    assert lines == [
        f"{dag_id}.r1.b: none (try 0 of at most 1)",
        "  trigger rule all_success: waits for every upstream task to succeed",
        "  upstream a: running",
        "  not decided yet: waits for a to finish",
    ]

    code, lines = _explain(dag_id, "r1", "a")
    assert code == 0 and lines[0] == f"{dag_id}.r1.a: running (try 1 of at most 1)"
    assert lines[1].startswith("  running since ") and "on host (worker w1)" in lines[1]


def test_explain_a_waiting_teardown_counts_its_setups_and_says_it_depends_on_past(
    settings: Settings, sessions: sessionmaker[Session], write_dag: Callable[[str, str], Path]
) -> None:
    dag_id = f"explain_{uuid.uuid4().hex[:8]}"
    write_dag(
        dag_id,
        f"""
from deferral import DAG
from deferral.operators import EmptyOperator

with DAG("{dag_id}"):
    s = EmptyOperator(task_id="s").as_setup()
    w = EmptyOperator(task_id="w")
    s >> w >> EmptyOperator(task_id="t", wait_for_downstream=True).as_teardown(setups=s)
""",
    )
    record_dags_folder(settings)
    ids = _run_of(sessions, dag_id, ["s", "w", "t"])
    with sessions.begin() as session:
        transitions.never_run(session, [ids["s"]], TaskState.SKIPPED, "test")
        transitions.never_run(session, [ids["w"]], TaskState.SKIPPED, "test")

    code, lines = _explain(dag_id, "r1", "t")
    assert code == 0, lines
    assert lines[1:] == [
        "  trigger rule all_done_setup_success: waits for every upstream task to finish, however"
        " it ends, and one of its setup tasks to succeed",
        "  upstream s: skipped",
        "  upstream w: skipped",
        "  depends_on_past: also waits until its task instances in the previous run succeeded or"
        " were skipped, and those of its direct downstream tasks",
        "  the rule says skipped: the scheduler sets it on its next pass",
    ]


def test_explain_a_scheduled_task_shows_its_pool_and_run_slots(
    settings: Settings, sessions: sessionmaker[Session], dag_id: str
) -> None:
    ids = _run_of(sessions, dag_id, ["a", "b"])
    with sessions.begin() as session:
        transitions.schedule(session, [ids["a"]])

    code, lines = _explain(dag_id, "r1", "a")
    assert code == 0, lines
    assert lines[1:] == [
        "  pool default_pool: 128 of 128 slots free, it needs 1",
        "  DAG max_active_tasks 16: 0 task(s) of this run queued or running",
        "  nothing holds it back: the scheduler dispatches it on its next pass",
    ]


def test_explain_a_finished_task_gives_the_last_reason(
    settings: Settings, sessions: sessionmaker[Session]
) -> None:
    ti_id = running_task(sessions)
    with sessions.begin() as session:
        transitions.fail(session, Attempt(ti_id, 1, WORKER), "ValueError: boom", allow_retry=False)

    code, lines = _explain(DAG_ID, "r1", "t")
    assert code == 0, lines
    assert lines[0] == f"{DAG_ID}.r1.t: failed (try 1 of at most 1)"
    assert lines[-1].startswith("  last change: running -> failed at ")
    assert lines[-1].endswith(": ValueError: boom")


def test_explain_refuses_an_unknown_dag_run_or_task_in_one_line(
    settings: Settings, sessions: sessionmaker[Session], dag_id: str
) -> None:
    _run_of(sessions, dag_id, ["a", "b"])
    for args, message in [
        ((dag_id, "r1", "nope"), f"error: DAG '{dag_id}' has no task 'nope'"),
        ((dag_id, "r9", "a"), f"error: DAG '{dag_id}' has no run 'r9'"),
        (("no_such_dag", "r1", "a"), "error: DAG 'no_such_dag' not found in "),
    ]:
        code, lines = _explain(*args)
        assert code == 1
        assert len(lines) == 1 and lines[0].startswith(message), lines


# -- rotate-fernet-key -----------------------------------------------------------------------------


# What each of _sealed's columns is sealed for.
_PURPOSES = (Purpose.TRIGGER_KWARGS, Purpose.RESUME_KWARGS, Purpose.EVENT)


def _sealed(sessions: sessionmaker[Session]) -> tuple[dict[int, str], ...]:
    """Every trigger.kwargs, task_instance.next_kwargs and next_event token, by row id."""
    with sessions() as session:
        kwargs = dict(session.execute(select(Trigger.id, Trigger.kwargs)).all())
        next_kwargs, next_event = (
            dict(session.execute(select(TaskInstance.id, column).where(column.is_not(None))).all())
            for column in (TaskInstance.next_kwargs, TaskInstance.next_event)
        )
    return kwargs, next_kwargs, next_event


def test_rotate_fernet_key_reseals_every_row_with_the_first_key(
    settings: Settings,
    sessions: sessionmaker[Session],
    cipher: Cipher,
    fernet_key: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for n in range(3):
        ti_id, trigger_id = deferred_task(
            sessions, cipher, run_id=f"r{n}", next_kwargs={"n": n, "secret": "s3"}
        )
    with sessions.begin() as session:  # one of them resumed by its trigger's event
        session.get_one(TaskInstance, ti_id).next_event = cipher.seal(
            Purpose.EVENT, {"fired": True}
        )
        # ...and its trigger's kwargs sealed as before keys were derived per purpose.
        legacy = Fernet(fernet_key).encrypt(serialization.dumps({"old": "style"}, "kwargs"))
        session.get_one(Trigger, trigger_id).kwargs = legacy.decode()
        # ...and a report its trigger made before firing.
        assert progress.record(session, [(trigger_id, cipher.seal(Purpose.EVENT, {"step": 1}))])
    before = _sealed(sessions)
    opened = [
        {i: cipher.open(purpose, t) for i, t in column.items()}
        for purpose, column in zip(_PURPOSES, before, strict=True)
    ]

    new_key = Fernet.generate_key().decode()
    monkeypatch.setenv("DEFERRAL_FERNET_KEY", f"{new_key},{fernet_key}")
    result = CliRunner().invoke(deferral_main, ["rotate-fernet-key", "--batch-size", "2"])
    assert result.exit_code == 0, result.output
    assert result.output.splitlines() == [
        "trigger.kwargs: 3 row(s) rotated",
        "task_instance.next_kwargs: 3 row(s) rotated",
        "task_instance.next_event: 1 row(s) rotated",
        "variable.val: 0 row(s) rotated",
        "connection.password: 0 row(s) rotated",
        "connection.extra: 0 row(s) rotated",
        "signal.payload: 0 row(s) rotated",
        "asset_watcher.kwargs: 0 row(s) rotated",
        "signal_wait.fired: 0 row(s) rotated",
        "trigger_progress.payload: 1 row(s) rotated",
    ]
    with sessions() as session:
        (report,) = progress.of_try(session, Cipher([new_key]), ti_id, 1).kept
    assert report.payload == {"step": 1}

    after = _sealed(sessions)
    new_only, old_only = Cipher([new_key]), Cipher([fernet_key])
    assert [
        {i: new_only.open(purpose, t) for i, t in column.items()}
        for purpose, column in zip(_PURPOSES, after, strict=True)
    ] == opened
    assert {"old": "style"} in opened[0].values()
    for purpose, column in zip(_PURPOSES, after, strict=True):
        for token in column.values():
            with pytest.raises(DecryptionError):
                old_only.open(purpose, token)
            with pytest.raises(InvalidToken):  # sealed under the purpose's key, not NEW itself
                Fernet(new_key).decrypt(token)


def test_rotate_fernet_key_reports_rows_no_key_decrypts_and_rotates_the_rest(
    settings: Settings,
    sessions: sessionmaker[Session],
    cipher: Cipher,
    fernet_key: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    ti_ok, trigger_ok = deferred_task(sessions, cipher, run_id="r1", next_kwargs={"a": 1})
    ti_bad, trigger_bad = deferred_task(sessions, cipher, run_id="r2")
    unknown = Cipher([Fernet.generate_key().decode()])
    with sessions.begin() as session:
        session.get_one(Trigger, trigger_bad).kwargs = unknown.seal(
            Purpose.TRIGGER_KWARGS, {"lost": True}
        )
        session.get_one(TaskInstance, ti_bad).next_kwargs = unknown.seal(
            Purpose.RESUME_KWARGS, {"lost": True}
        )
    before = _sealed(sessions)

    new_key = Fernet.generate_key().decode()
    monkeypatch.setenv("DEFERRAL_FERNET_KEY", f"{new_key},{fernet_key}")
    result = CliRunner().invoke(deferral_main, ["rotate-fernet-key"])
    assert result.exit_code == 1, result.output
    lines = result.output.splitlines()
    assert "trigger.kwargs: 1 row(s) rotated, 1 left as they were (unreadable)" in lines
    assert "task_instance.next_kwargs: 1 row(s) rotated, 1 left as they were (unreadable)" in lines
    assert f"error: trigger id {trigger_bad}: kwargs decrypts with no configured key" in lines
    assert f"error: task_instance id {ti_bad}: next_kwargs decrypts with no configured key" in lines

    kwargs, next_kwargs, _ = _sealed(sessions)
    new_only = Cipher([new_key])
    assert new_only.open(Purpose.TRIGGER_KWARGS, kwargs[trigger_ok]) == cipher.open(
        Purpose.TRIGGER_KWARGS, before[0][trigger_ok]
    )
    assert new_only.open(Purpose.RESUME_KWARGS, next_kwargs[ti_ok]) == {"a": 1}
    assert (kwargs[trigger_bad], next_kwargs[ti_bad]) == (before[0][trigger_bad], before[1][ti_bad])
