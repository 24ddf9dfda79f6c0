"""A real ``deferral webserver`` process on loopback under what the issue's probes sent: 40
concurrent wrong Basic credentials (its memory, measured in /proc, and another client's page
stay small and served), a DNS-rebinding Host header, and malformed parameters (400, and no
traceback in its log)."""

from __future__ import annotations

import base64
import http.client
import json
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy.orm import Session, sessionmaker

from deferral.runtime.config import Settings
from deferral_cli.embedded import free_port
from tests.e2e.conftest import Services, command
from tests.helpers import wait_for
from tests.parsed_dags import record_dags_folder
from webserver import users

pytestmark = pytest.mark.e2e

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "example_deferrable.py"
DAG_ID = "example_deferrable"
ADMIN_PASSWORD = "attack-admin-password"
MAX_RSS_BYTES = 800 * 1024 * 1024


class Server:
    def __init__(self, pid: int, port: int) -> None:
        self.pid, self.port = pid, port

    def request(
        self,
        method: str,
        path: str,
        *,
        headers: dict[str, str] | None = None,
        body: bytes | None = None,
    ) -> tuple[int, bytes]:
        connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        try:
            connection.request(method, path, body=body, headers=headers or {})
            answer = connection.getresponse()
            return answer.status, answer.read()
        finally:
            connection.close()

    def rss_bytes(self) -> int:
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        raise AssertionError("no VmRSS line")


@pytest.fixture
def server(
    services: Services, dags_folder: Path, settings: Settings, sessions: sessionmaker[Session]
) -> Iterator[Server]:
    shutil.copy(EXAMPLE, dags_folder / EXAMPLE.name)
    record_dags_folder(settings)  # the web UI shows what a scheduler parsed
    port = free_port()
    proc = services.spawn(
        "webserver",
        command("deferral", "webserver", "--host", "127.0.0.1", "--port", str(port)),
        {**services.env, users.ADMIN_PASSWORD_ENV: ADMIN_PASSWORD},
    )
    running = Server(proc.pid, port)

    def answers() -> bool:
        try:
            return running.request("GET", f"/dags/{DAG_ID}")[0] == 200
        except OSError:
            return False

    wait_for(answers, timeout=120, what="the webserver to serve the DAG's page")
    yield running


def _basic(username: str, password: str) -> str:
    return "Basic " + base64.b64encode(f"{username}:{password}".encode()).decode()


def test_40_concurrent_wrong_basic_credentials_keep_memory_and_other_pages_small(
    server: Server, services: Services
) -> None:
    before = server.rss_bytes()
    peak = before
    storming = threading.Event()
    storming.set()

    def sample() -> None:
        nonlocal peak
        while storming.is_set():
            peak = max(peak, server.rss_bytes())
            time.sleep(0.02)

    statuses: list[int] = []

    def guess(n: int) -> None:
        status, _ = server.request(
            "POST",
            f"/api/v1/dags/{DAG_ID}/pause",
            headers={
                "authorization": _basic(f"user{n}", f"wrong-password-{n}"),
                "content-type": "application/json",
            },
            body=b"{}",
        )
        statuses.append(status)

    sampler = threading.Thread(target=sample)
    sampler.start()
    guessers = [threading.Thread(target=guess, args=(n,)) for n in range(40)]
    for thread in guessers:
        thread.start()
    # Another client's page is served all through the guesses. (That the argon2 work runs off
    # the event loop, at most one per core, is shown without a stopwatch, which a loaded
    # machine breaks: tests/integration/test_webserver_hardening.py::
    # test_argon2_verifications_are_bounded_and_off_the_event_loop.)
    pages = 0
    while any(thread.is_alive() for thread in guessers) or pages < 5:
        assert server.request("GET", f"/dags/{DAG_ID}")[0] == 200
        pages += 1
    for thread in guessers:
        thread.join()
    storming.clear()
    sampler.join()

    assert sorted(set(statuses)) == [401, 429], statuses
    assert peak < MAX_RSS_BYTES, (before, peak)
    log = services.log("webserver")
    assert "basic auth: refused a login as 'user" in log
    assert "Traceback" not in log


def test_a_rebinding_host_and_malformed_parameters_get_400_without_traceback(
    server: Server, services: Services
) -> None:
    evil, _ = server.request("GET", f"/dags/{DAG_ID}", headers={"host": "evil.example"})
    assert evil == 400
    for host in ("localhost", f"127.0.0.1:{server.port}", f"[::1]:{server.port}"):
        assert server.request("GET", "/api/v1/health", headers={"host": host})[0] == 200

    ti = f"/api/v1/dags/{DAG_ID}/task_instance"
    for path in (
        f"{ti}?run_id=a%00b&task_id=wait",
        f"{ti}?run_id=r&task_id=wait&try_number={10**30}",
        f"{ti}/log?run_id=r&task_id=wait&try_number=1&after_id={2**70}",
        f"{ti}?run_id={'r' * 251}&task_id=wait",
        f"/api/v1/dags/{DAG_ID}%00/task_instance?run_id=r&task_id=wait",
    ):
        status, body = server.request("GET", path)
        assert status == 400, (path, body[:300])
        assert b"\n" not in body.strip()
    deep = b'{"conf": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    status, body = server.request(
        "POST",
        f"/api/v1/dags/{DAG_ID}/runs",
        headers={
            "authorization": _basic("admin", ADMIN_PASSWORD),
            "content-type": "application/json",
        },
        body=deep,
    )
    assert status == 400 and "nests deeper" in json.loads(body)["error"]
    log = services.log("webserver")
    assert "Traceback" not in log and "Internal Server Error" not in log
