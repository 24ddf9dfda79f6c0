"""`deferral health` against the test servers: the container healthcheck of every service."""

from __future__ import annotations

import datetime as dt
import socket
import threading

import pytest
import uvicorn
from click.testing import CliRunner
from sqlalchemy import func, update
from sqlalchemy.orm import Session, sessionmaker

from deferral.runtime.config import Settings
from deferral.store import liveness
from deferral.store.tables import Triggerer, Worker
from deferral_cli import main as deferral_main
from scheduler.service import SchedulerService
from tests.helpers import wait_for
from webserver.app import create_app


def _health(*args: str) -> tuple[int, list[str]]:
    result = CliRunner().invoke(deferral_main, ["health", *args])
    return result.exit_code, result.output.splitlines()


def _worker_row(sessions: sessionmaker[Session], name: str) -> None:
    values = {
        "name": name,
        "hostname": "host",
        "pid": 1,
        "queue": "default",
        "concurrency": 4,
        "state": liveness.RUNNING,
    }
    with sessions.begin() as session:
        liveness.heartbeat(session, Worker, values)


def test_without_a_service_it_checks_that_postgres_and_redis_answer(
    settings: Settings, sessions: sessionmaker[Session]
) -> None:
    code, lines = _health()
    assert code == 0, lines
    assert [line.split(":")[0] for line in lines] == ["ok  postgres", "ok  redis"]


def test_a_worker_whose_heartbeat_is_fresh_is_healthy_and_one_gone_stale_is_not(
    settings: Settings, sessions: sessionmaker[Session]
) -> None:
    _worker_row(sessions, "worker-1")
    code, lines = _health("--service", "worker", "--name", "worker-1")
    assert code == 0, lines
    assert lines[1].startswith("ok  worker worker-1: running, heartbeat ")

    stale = func.now() - dt.timedelta(seconds=3 * liveness.stale_after_sec(settings.heartbeat_sec))
    with sessions.begin() as session:
        session.execute(update(Worker).values(latest_heartbeat=stale))
    code, lines = _health("--service", "worker", "--name", "worker-1")
    assert code == 1
    assert lines[1].startswith("fail  worker worker-1: heartbeat ")
    assert "stuck or gone" in lines[1]


def test_a_name_without_a_row_is_unhealthy(
    settings: Settings, sessions: sessionmaker[Session]
) -> None:
    _worker_row(sessions, "worker-1")
    code, lines = _health("--service", "triggerer", "--name", "worker-1")
    assert code == 1
    assert "fail  triggerer worker-1: no heartbeat recorded" in lines[1]


def test_the_scheduler_heartbeats_its_row_and_is_unhealthy_once_stopped(
    settings: Settings, sessions: sessionmaker[Session]
) -> None:
    scheduler = SchedulerService(settings, name="scheduler-1")
    scheduler.registration.record()
    code, lines = _health("--service", "scheduler", "--name", "scheduler-1")
    assert code == 0, lines
    scheduler.registration.record(liveness.STOPPED)
    code, lines = _health("--service", "scheduler", "--name", "scheduler-1")
    assert code == 1
    assert lines[1].startswith("fail  scheduler scheduler-1: stopped")
    scheduler.engine.dispose()


def test_a_triggerer_row_counts_too(settings: Settings, sessions: sessionmaker[Session]) -> None:
    values = {"name": "triggerer-1", "hostname": "h", "pid": 1, "capacity": 10, "state": "running"}
    with sessions.begin() as session:
        liveness.heartbeat(session, Triggerer, values)
    code, lines = _health("--service", "triggerer", "--name", "triggerer-1")
    assert code == 0, lines


@pytest.mark.parametrize(
    ("variable", "url", "line"),
    [
        (
            "DEFERRAL_DATABASE_URL",
            "postgresql+psycopg://deferral:hunter2@127.0.0.1:1/deferral",
            "fail  postgres: cannot reach PostgreSQL at 127.0.0.1:1/deferral: connection refused",
        ),
        (
            "DEFERRAL_REDIS_URL",
            "redis://:hunter2@127.0.0.1:1/0",
            "fail  redis: cannot reach Redis at 127.0.0.1:1: connection refused",
        ),
    ],
)
def test_a_server_that_does_not_answer_fails_in_one_line_with_exit_1_not_2(
    settings: Settings,
    monkeypatch: pytest.MonkeyPatch,
    variable: str,
    url: str,
    line: str,
) -> None:
    # Docker reserves exit code 2 of a healthcheck: unhealthy is 1, however it fails.
    monkeypatch.setenv(variable, url)
    code, lines = _health()
    assert code == 1
    failed = [text for text in lines if text.startswith("fail")]
    assert len(failed) == 1 and failed[0].startswith(line), lines
    assert "hunter2" not in "\n".join(lines)
    assert not any("Traceback" in text for text in lines)


def test_a_bad_setting_is_unhealthy_in_one_line_with_exit_1(
    settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DEFERRAL_FERNET_KEY", "not-a-key")
    code, lines = _health()
    assert code == 1
    assert lines == [
        "fail  settings: DEFERRAL_FERNET_KEY is malformed: key 1 is not a valid Fernet key"
    ]


def test_service_and_name_go_together(settings: Settings) -> None:
    result = CliRunner().invoke(deferral_main, ["health", "--service", "worker"])
    assert result.exit_code == 2
    assert "--service and --name go together" in result.output


def test_the_web_ui_is_healthy_while_its_health_page_answers(
    settings: Settings, sessions: sessionmaker[Session], monkeypatch: pytest.MonkeyPatch
) -> None:
    with socket.socket() as probe:  # a port nobody listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    monkeypatch.setenv("DEFERRAL_WEBSERVER_PORT", str(port))
    url = f"http://127.0.0.1:{port}/api/v1/health"
    code, lines = _health("--service", "webserver")
    assert code == 1
    assert lines[-1] == f"fail  webserver: no answer at {url}: Connection refused"

    app = create_app(settings, host="127.0.0.1")
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_config=None))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        wait_for(lambda: server.started, timeout=30, what="the web UI to start")
        code, lines = _health("--service", "webserver")
    finally:
        server.should_exit = True
        thread.join(timeout=30)
    assert code == 0, lines
    assert lines[-1] == f"ok  webserver: answers at {url}"


def test_the_web_ui_takes_no_name() -> None:
    result = CliRunner().invoke(deferral_main, ["health", "--service", "webserver", "--name", "w"])
    assert result.exit_code == 2
    assert "--service webserver takes no --name" in result.output
