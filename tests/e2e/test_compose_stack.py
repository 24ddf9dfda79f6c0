"""compose.yaml as local processes: every service built from the Dockerfile is started with the
very command and environment the file declares (as Compose resolves them), against the test
servers standing in for its `postgres` and `redis`; the example DAG `example_deferrable` runs
through them to success. A copy of the file that breaks a service fails here too.

Only what a container would see differently is changed: the servers' addresses (and the test
database and credentials), container paths mapped back to the host paths mounted there, a free
port for the web UI (a container has its ports to itself), and a stream prefix of the test's own
so that nothing else on the test Redis is touched.
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session, sessionmaker

from deferral.store.tables import DagRun, TaskInstance, TaskStateChange
from deferral_cli.embedded import free_port
from tests.compose_stack import COMPOSE_FILE, model, scratch_project
from tests.e2e.conftest import CLI, Services, command
from tests.helpers import wait_for
from tests.servers import REDIS_URL

pytestmark = pytest.mark.e2e

WEB_PORT = "DEFERRAL_WEBSERVER_PORT"
# Every container has its own; local processes each get a free one instead.
METRICS_PORT = "DEFERRAL_METRICS_PORT"
ADMIN_PASSWORD = "compose-admin-pass"


class StackFailed(AssertionError):
    """A service of the stack did not come up or did not do its work."""


@dataclass(frozen=True)
class LocalService:
    name: str
    command: list[str]
    env: dict[str, str]
    healthcheck: list[str]
    one_shot: bool  # others wait for it to complete successfully


def _on_test_servers(
    env: dict[str, str], database_url: str, prefix: str, web_port: int
) -> dict[str, str]:
    """The declared environment with the test servers in place of the stack's (the database
    URL keeps its driver and query, the Redis URL its database number), and the web UI on
    ``web_port``."""
    declared_db = make_url(env["DEFERRAL_DATABASE_URL"])
    test_db = make_url(database_url)
    moved_db = declared_db.set(
        host=test_db.host,
        port=test_db.port,
        username=test_db.username,
        password=test_db.password,
        database=test_db.database,
    )
    declared_redis, test_redis = env["DEFERRAL_REDIS_URL"], REDIS_URL
    redis_db = declared_redis.rsplit("/", 1)[1]
    return {
        **env,
        "DEFERRAL_DATABASE_URL": moved_db.render_as_string(hide_password=False),
        # The stack's password is the stack's database's; the test server's is in the URL.
        "DEFERRAL_DATABASE_PASSWORD": "",
        "DEFERRAL_REDIS_URL": f"{test_redis.rsplit('/', 1)[0]}/{redis_db}",
        "DEFERRAL_STREAM_PREFIX": prefix,
        **({WEB_PORT: str(web_port)} if WEB_PORT in env else {}),
        **({METRICS_PORT: str(free_port())} if METRICS_PORT in env else {}),
    }


def _host_paths(env: dict[str, str], volumes: list[dict[str, Any]], service: str) -> dict[str, str]:
    """Container paths in ``env`` (those under a bind mount) as the host paths mounted there;
    DEFERRAL_DAGS_FOLDER must be under one."""
    mounts = {v["target"]: v["source"] for v in volumes if v.get("type") == "bind"}

    def host(value: str) -> str:
        for target, source in mounts.items():
            if value == target or value.startswith(target + "/"):
                return source + value[len(target) :]
        return value

    moved = {key: host(value) for key, value in env.items()}
    if moved["DEFERRAL_DAGS_FOLDER"] == env["DEFERRAL_DAGS_FOLDER"]:
        raise StackFailed(
            f"{service}: DEFERRAL_DAGS_FOLDER {env['DEFERRAL_DAGS_FOLDER']} is not mounted"
        )
    return moved


def local_services(
    compose_model: dict[str, Any], database_url: str, prefix: str, web_port: int
) -> list[LocalService]:
    """The services built from the Dockerfile (postgres and redis are the test servers), one-shot
    services first; the web UI listens on ``web_port``."""
    found = []
    for name, service in compose_model["services"].items():
        if "build" not in service:
            continue
        env = _on_test_servers(dict(service["environment"]), database_url, prefix, web_port)
        env = _host_paths(env, service.get("volumes", []), name)
        # The web UI's own address in its healthcheck moves with it.
        declared_port = service["environment"].get(WEB_PORT)
        test = [
            arg.replace(f"127.0.0.1:{declared_port}", f"127.0.0.1:{web_port}")
            if declared_port
            else arg
            for arg in service["healthcheck"]["test"]
        ]
        if test[0] != "CMD":
            raise StackFailed(f"{name}: healthcheck {test[0]} cannot run without a container")
        found.append(
            LocalService(
                name=name,
                command=list(service["command"]),
                env=env,
                healthcheck=test[1:],
                one_shot=service.get("restart") == "no",
            )
        )
    waited_on = {
        dep
        for service in compose_model["services"].values()
        for dep, how in (service.get("depends_on") or {}).items()
        if how["condition"] == "service_completed_successfully"
    }
    assert waited_on == {s.name for s in found if s.one_shot}
    return sorted(found, key=lambda s: not s.one_shot)


def _argv(argv: list[str]) -> list[str]:
    """A container command run from the test's environment (its console scripts)."""
    return command(argv[0], *argv[1:])


def _process_env(env: dict[str, str]) -> dict[str, str]:
    # What the image has besides the declared variables (Dockerfile ENV), nothing of the test's.
    base = {name: os.environ[name] for name in ("PATH", "HOME") if name in os.environ}
    return {**base, "PYTHONUNBUFFERED": "1", "PYTHONDONTWRITEBYTECODE": "1", **env}


def start_stack(stack: list[LocalService], services: Services, workdir: Path) -> None:
    """Run the one-shot services to completion, start the others, and wait until each one's
    healthcheck passes; StackFailed names the service that did not make it."""
    for service in stack:
        if service.one_shot:
            done = subprocess.run(
                _argv(service.command),
                env=_process_env(service.env),
                cwd=workdir,
                capture_output=True,
                text=True,
                timeout=120,
            )
            if done.returncode != 0:
                raise StackFailed(f"{service.name} exited {done.returncode}: {done.stderr}")
        else:
            services.spawn(
                service.name, _argv(service.command), _process_env(service.env), cwd=workdir
            )
    waiting = [s for s in stack if not s.one_shot]

    def none_exited() -> None:
        for service in stack:
            proc = services.procs.get(service.name)
            if proc is not None and proc.poll() is not None:
                log = services.log(service.name)[-2000:]
                raise StackFailed(f"{service.name} exited {proc.returncode}: {log}")

    def all_healthy() -> bool:
        for service in list(waiting):
            none_exited()
            if _healthy(service, workdir):
                waiting.remove(service)
        return not waiting

    wait_for(all_healthy, timeout=180, interval=1.0, what="every healthcheck to pass")


def _healthy(service: LocalService, workdir: Path) -> bool:
    """One healthcheck, as the engine runs it: one that does not answer in time is a failed
    check, retried at the next interval. (Each is a ``deferral`` command, polled every second:
    run as the e2e tests' CLI commands are, a process forked with the CLI imported; the
    standard-library probe ``deferral-healthcheck`` starts as cheaply as a fork.)"""
    program, *args = service.healthcheck
    env = _process_env(service.env)
    try:
        if program == "deferral-healthcheck":
            check = subprocess.run(
                _argv(service.healthcheck), env=env, cwd=workdir, capture_output=True, timeout=30
            )
        else:
            assert program == "deferral", f"{service.name}: a healthcheck of another program"
            check = CLI.run(args, env, timeout=30, cwd=workdir)
    except subprocess.TimeoutExpired:
        return False
    return check.returncode == 0


@pytest.fixture
def project(tmp_path: Path, fernet_key: str) -> Path:
    directory = tmp_path / "project"
    directory.mkdir()
    return scratch_project(
        directory,
        {
            "DEFERRAL_FERNET_KEY": fernet_key,
            "POSTGRES_PASSWORD": "secret",
            "DEFERRAL_WEBSERVER_ADMIN_PASSWORD": ADMIN_PASSWORD,
        },
    )


def test_the_stack_compose_declares_runs_the_example_dag(
    project: Path,
    database_url: str,
    stream_prefix: str,
    services: Services,
    sessions: sessionmaker[Session],
    tmp_path: Path,
) -> None:
    web_port = free_port()
    stack = local_services(model(project, COMPOSE_FILE), database_url, stream_prefix, web_port)
    assert stack[0].name == "migrate"
    start_stack(stack, services, tmp_path)

    # The CLI as `docker compose exec scheduler-1 deferral ...` runs it.
    scheduler = next(s for s in stack if s.name == "scheduler-1")
    triggered = subprocess.run(
        # No wait beyond the deferral itself: the example's default would only add its seconds.
        _argv(
            [
                "deferral",
                "dags",
                "trigger",
                "example_deferrable",
                "--conf",
                '{"wait_seconds": 0}',
                "--wait",
                "--timeout",
                "120",
            ]
        ),
        env=_process_env(scheduler.env),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert triggered.returncode == 0, triggered.stdout + triggered.stderr

    with sessions() as session:
        run = session.scalars(select(DagRun).where(DagRun.dag_id == "example_deferrable")).one()
        states = dict(
            session.execute(
                select(TaskInstance.task_id, TaskInstance.state).where(
                    TaskInstance.run_id == run.run_id
                )
            ).all()
        )
        deferred = session.scalars(
            select(TaskStateChange.to_state)
            .join(TaskInstance, TaskInstance.id == TaskStateChange.task_instance_id)
            .where(TaskInstance.task_id == "wait", TaskStateChange.to_state == "deferred")
        ).all()
    assert run.state == "success"
    assert states == {"wait": "success", "report": "success"}
    assert deferred == ["deferred"]  # it really waited on a triggerer, once

    # Every service serves its metrics; the triggerers between them fired the one trigger.
    fired = 0.0
    for service in stack:
        if service.command[0] not in ("scheduler", "worker", "triggerer"):
            continue
        url = f"http://127.0.0.1:{service.env[METRICS_PORT]}/metrics"
        with urllib.request.urlopen(url, timeout=30) as answer:
            shown = answer.read().decode()
        # A sample line (not only HELP) of a metric only this kind of service serves.
        own = {
            "scheduler": "deferral_dispatches_total ",
            "worker": "deferral_worker_slots_free ",
            "triggerer": "deferral_triggers_running ",
        }[service.command[0]]
        assert any(line.startswith(own) for line in shown.splitlines()), service.name
        fired += sum(
            float(line.split()[-1])
            for line in shown.splitlines()
            if line.startswith("deferral_triggers_fired_total ")
        )
    assert fired == 1

    # The web UI listens on every address, so it shows nothing without a login.
    grid_url = f"http://127.0.0.1:{web_port}/api/v1/dags/example_deferrable"
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(grid_url, timeout=30)
    assert refused.value.code == 401
    login = base64.b64encode(f"admin:{ADMIN_PASSWORD}".encode()).decode()
    asked = urllib.request.Request(grid_url, headers={"Authorization": f"Basic {login}"})
    with urllib.request.urlopen(asked, timeout=30) as answer:
        grid = json.load(answer)
    assert [run["state"] for run in grid["runs"]] == ["success"]
    assert grid["graph"]["states"] == {"wait": "success", "report": "success"}


def test_a_compose_file_that_breaks_a_service_fails_the_stack(
    project: Path,
    database_url: str,
    stream_prefix: str,
    services: Services,
    sessions: sessionmaker[Session],
    tmp_path: Path,
) -> None:
    text = COMPOSE_FILE.read_text()
    wrong = '"--name", "triggerer-2"]'
    assert wrong in text, "compose.yaml changed: update this test"
    broken = project / "broken.yaml"
    broken.write_text(text.replace(wrong, '"--name", "triggerer-2", "--capacity", "0"]'))

    stack = local_services(model(project, broken), database_url, stream_prefix, free_port())
    # What the broken service depends on, and it: the other services (a whole stack, seconds of
    # CPU each) were just shown to start by the test above.
    needed = [s for s in stack if s.one_shot or s.name == "triggerer-2"]
    assert len(needed) == 2
    with pytest.raises(StackFailed, match=r"(?s)triggerer-2 exited 2: .*--capacity"):
        start_stack(needed, services, tmp_path)
