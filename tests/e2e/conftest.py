"""Real service processes (``scheduler consume``, ``worker consume``, ``triggerer consume``) run
from the installed console scripts against the test database and Redis prefix."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from broker.client import Broker

BIN = Path(sys.executable).parent
# A worker starts and warms one task process per slot before it takes work (16 by default):
# seconds of CPU per start on a loaded machine. Tests get two unless they ask for more.
TEST_WORKER_CONCURRENCY = "2"


def command(name: str, *args: str) -> list[str]:
    """The console script ``name`` next to this interpreter, else ``python -m name``."""
    script = BIN / name
    return [str(script), *args] if script.exists() else [sys.executable, "-m", name, *args]


class Services:
    def __init__(self, env: dict[str, str], logs: Path) -> None:
        self.env = {**os.environ, **env, "PYTHONUNBUFFERED": "1"}
        self.logs = logs
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def start(
        self, name: str, *args: str, env: dict[str, str] | None = None
    ) -> subprocess.Popen[bytes]:
        """Start ``<service> consume [args]``; ``name`` is unique per process (worker2, ...);
        ``env`` adds to the environment of this process only. A name started again appends to
        its log. A worker started without ``--concurrency`` gets TEST_WORKER_CONCURRENCY."""
        service = name.rstrip("0123456789")
        if service == "worker" and not any(a.startswith("--concurrency") for a in args):
            args = ("--concurrency", TEST_WORKER_CONCURRENCY, *args)
        return self.spawn(name, command(service, "consume", *args), {**self.env, **(env or {})})

    def spawn(
        self, name: str, argv: list[str], env: dict[str, str], cwd: Path | None = None
    ) -> subprocess.Popen[bytes]:
        """Start ``argv`` with exactly ``env``, logging to ``<name>.log``; stopped at teardown."""
        log = (self.logs / f"{name}.log").open("ab")
        proc = subprocess.Popen(argv, env=env, cwd=cwd, stdout=log, stderr=subprocess.STDOUT)
        self.procs[name] = proc
        return proc

    def run(
        self, *args: str, timeout: float = 180, env: dict[str, str] | None = None
    ) -> subprocess.CompletedProcess[str]:
        """Run a ``deferral`` CLI command to completion; ``env`` adds to its environment. (The
        timeout is slack for a loaded machine, where starting the CLI alone takes seconds.)"""
        return subprocess.run(
            command("deferral", *args),
            env={**self.env, **(env or {})},
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    def log(self, name: str) -> str:
        return (self.logs / f"{name}.log").read_text(errors="replace")

    def stop_all(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGCONT)  # a stopped process cannot handle SIGTERM
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs.values():
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@pytest.fixture
def services(
    service_env: dict[str, str],
    tmp_path: Path,
    request: pytest.FixtureRequest,
    broker: Broker,  # torn down after the services stop, so keys outlive the processes
) -> Iterator[Services]:
    logs = tmp_path / "logs"
    logs.mkdir()
    running = Services(service_env, logs)
    yield running
    running.stop_all()
    report = getattr(request.node, "rep_call", None)
    if report is not None and report.failed:
        for name in running.procs:
            sys.stderr.write(f"\n----- {name} log -----\n{running.log(name)[-6000:]}\n")


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> object:
    report = yield
    setattr(item, f"rep_{report.when}", report)
    return report
