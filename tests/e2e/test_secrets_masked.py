"""Canary secrets through real services: a secret Variable in an ``HttpTrigger`` URL (as its user
info and in its query string) and a Connection's password pushed as an XCom reach the endpoint
and the database, and nothing else: no Redis command (MONITOR sees every one, streams and keys
alike), no stream entry, no service log line, no web page or API answer, no CLI output."""

from __future__ import annotations

import base64
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import ClassVar
from urllib.parse import quote

import pytest
import redis
from starlette.testclient import TestClient

from broker.client import Broker
from deferral.runtime.config import Settings
from tests.e2e.conftest import Services
from tests.helpers import wait_for
from webserver.app import create_app

pytestmark = pytest.mark.e2e

VAR_CANARY = "cnry-var-8f3k2m"  # the value of a secret Variable
CONN_CANARY = "cnry-conn-5q7w1z"  # a Connection's password
CANARIES = (
    VAR_CANARY,
    CONN_CANARY,
    quote(VAR_CANARY),
    base64.b64encode(b"svc:" + VAR_CANARY.encode()).decode(),
)

DAG = """
from deferral import DAG, BaseOperator, Connection, Variable
from deferral.operators import PythonOperator
from deferral.triggers import HttpTrigger


class CallsTheApi(BaseOperator):
    def execute(self, context):
        secret, port = Variable.get("api_secret"), Variable.get("endpoint_port")
        url = f"http://svc:{secret}@127.0.0.1:{port}/ready?token={secret}"
        print(f"calling {url}")
        self.defer(trigger=HttpTrigger(url, 200, poll_interval=0.5), method_name="resume")

    def resume(self, context, event=None):
        print(f"the endpoint answered: {event}")
        return event


def leak():
    return Connection.get_connection_from_secrets("warehouse").password


with DAG("e2e_secrets") as dag:
    CallsTheApi(task_id="call") >> PythonOperator(task_id="leak", python_callable=leak)
"""


class _Endpoint(BaseHTTPRequestHandler):
    """200 only to the credentials the task was given, as Basic auth and in the query."""

    expected: ClassVar[tuple[str, str]] = ("", "")
    answered: ClassVar[list[int]] = []

    def do_GET(self) -> None:
        auth, path = self.expected
        status = 200 if (self.headers.get("Authorization"), self.path) == (auth, path) else 401
        self.answered.append(status)
        self.send_response(status)
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def endpoint() -> Iterator[int]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Endpoint)
    basic = base64.b64encode(f"svc:{VAR_CANARY}".encode()).decode()
    _Endpoint.expected, _Endpoint.answered = (f"Basic {basic}", f"/ready?token={VAR_CANARY}"), []
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield int(server.server_address[1])
    server.shutdown()


class RedisMonitor:
    """Every command any client sends to Redis while it runs (MONITOR), kept if it holds a
    canary."""

    def __init__(self, url: str) -> None:
        self.client = redis.Redis.from_url(url)
        self.seen: list[str] = []
        self.commands = 0
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._watch, daemon=True)

    def _watch(self) -> None:
        with self.client.monitor() as monitor:
            while not self.stopping.is_set():
                command = str(monitor.next_command()["command"])
                self.commands += 1
                if any(canary in command for canary in CANARIES):
                    self.seen.append(command)

    def __enter__(self) -> RedisMonitor:
        self.thread.start()
        wait_for(lambda: self.commands > 0 or self._poke(), timeout=30, what="MONITOR running")
        return self

    def _poke(self) -> bool:
        self.client.ping()  # a command for the monitor to see
        return False

    def __exit__(self, *exc: object) -> None:
        self.stopping.set()
        self.client.ping()  # wakes the monitor so it sees the flag
        self.thread.join(timeout=30)
        self.client.close()


def _assert_no_canary(text: str, where: str) -> None:
    for canary in CANARIES:
        assert canary not in text, f"{canary} in {where}: {text[:2000]}"


def test_canary_secrets_appear_in_no_stream_log_page_or_cli_output(
    services: Services,
    dags_folder: Path,
    endpoint: int,
    broker: Broker,
    settings: Settings,
) -> None:
    (dags_folder / "e2e_secrets_dag.py").write_text(DAG)
    for args in (
        ("variables", "set", "api_secret", VAR_CANARY),
        ("variables", "set", "endpoint_port", str(endpoint)),
        ("connections", "add", "warehouse", "--conn-uri", f"postgres://u:{CONN_CANARY}@db/x"),
    ):
        done = services.run(*args)
        assert done.returncode == 0, done.stdout + done.stderr
    streams_seen: list[str] = []

    def read_every_stream() -> None:
        for key in broker.redis.scan_iter(match=f"{broker.keys.prefix}:*", _type="stream"):
            streams_seen.append(repr(broker.redis.xrange(key)))

    with RedisMonitor(services.env["DEFERRAL_REDIS_URL"]) as monitor:
        services.start("scheduler")
        services.start("worker", "--concurrency", "2")
        services.start("triggerer")
        run = services.run(
            "dags", "trigger", "e2e_secrets", "--run-id", "r1", "--wait", timeout=240
        )
        assert run.returncode == 0, run.stdout + run.stderr
        read_every_stream()
    assert 200 in _Endpoint.answered  # the credentials reached the endpoint, as Basic auth
    assert monitor.commands > 0 and monitor.seen == []
    _assert_no_canary("\n".join(streams_seen), "a stream")
    for name in ("scheduler", "worker", "triggerer"):
        _assert_no_canary(services.log(name), f"the {name}'s log")

    outputs = {
        " ".join(args): services.run(*args)
        for args in (
            ("tasks", "logs", "e2e_secrets", "r1", "call"),
            ("tasks", "logs", "e2e_secrets", "r1", "leak"),
            ("xcom", "list", "e2e_secrets", "r1"),
            ("xcom", "list", "e2e_secrets", "r1", "--json"),
            ("xcom", "get", "e2e_secrets", "r1", "call"),
            ("xcom", "get", "e2e_secrets", "r1", "leak"),
            ("runs", "show", "e2e_secrets", "r1", "--history"),
            ("tasks", "list"),
            ("triggers", "list"),
            ("streams",),
            ("connections", "list"),
            ("variables", "list"),
        )
    }
    for said, done in outputs.items():
        assert done.returncode == 0, (said, done.stderr)
        _assert_no_canary(done.stdout + done.stderr, f"`deferral {said}`")
    assert "calling http://svc:***@127.0.0.1:" in outputs["tasks logs e2e_secrets r1 call"].stdout
    assert outputs["xcom get e2e_secrets r1 leak"].stdout.strip() == '"***"'

    tasks = [{"run_id": "r1", "task_id": task_id} for task_id in ("call", "leak")]
    reads = [
        ("/dags/e2e_secrets", {}),
        ("/api/v1/dags/e2e_secrets", {}),
        ("/deferred", {}),
        ("/api/v1/streams", {}),
        *[("/dags/e2e_secrets/task_instance", task) for task in tasks],
        *[("/api/v1/dags/e2e_secrets/task_instance", task) for task in tasks],
        *[("/api/v1/dags/e2e_secrets/task_instance/log", {**t, "try_number": 1}) for t in tasks],
    ]
    app = create_app(settings, host="127.0.0.1", environ={})
    with TestClient(app, base_url="http://localhost") as web:
        answers = {f"{path} {params}": web.get(path, params=params) for path, params in reads}
    for path, answer in answers.items():
        assert answer.status_code == 200, (path, answer.text[:500])
        _assert_no_canary(answer.text, path)
