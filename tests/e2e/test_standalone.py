"""The README's demo: `deferral standalone` with nothing configured starts embedded PostgreSQL and
Redis, runs the example DAG through all three services, and stops everything."""

from __future__ import annotations

import json
import os
import queue
import shlex
import signal
import subprocess
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.conftest import command
from tests.helpers import wait_for

pytestmark = pytest.mark.e2e

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The first test's working directory, empty when it starts (the README's demo, from
    nothing); the second keeps its servers in the ``.deferral`` the first made there, instead of
    paying for a second ``initdb`` (it starts them twice on one home either way)."""
    return tmp_path_factory.mktemp("standalone")


# Started from a folder holding files named like our services and the standard library's json
# (a DAGs folder often does): every service still imports our packages, not these.
SHADOWS = ("scheduler", "worker", "triggerer", "webserver", "broker", "json")


def test_standalone_runs_the_example_on_embedded_servers(workdir: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DEFERRAL_")}
    for name in SHADOWS:
        (workdir / f"{name}.py").write_text(f"raise SystemExit('{name}.py of the cwd ran')\n")
    done = subprocess.run(
        command(
            "deferral",
            "standalone",
            "--dags-folder",
            str(EXAMPLES),
            "--run",
            "example_deferrable",
            "--conf",
            '{"wait_seconds": 0}',  # no wait beyond the deferral itself
            "--timeout",
            "120",
        ),
        cwd=workdir,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "example_deferrable manual__" in done.stdout
    assert "  wait: success (try 1)" in done.stdout
    assert "running -> deferred (deferred to trigger" in done.stdout
    assert "  report: success (try 1)" in done.stdout
    # Embedded servers: the data and the key live in the working directory.
    assert (workdir / ".deferral" / "pgdata").is_dir()
    assert (workdir / ".deferral" / "fernet.key").is_file()


def _start(
    home: Path, cwd: Path, env: dict[str, str], stderr: Any = subprocess.DEVNULL
) -> tuple[subprocess.Popen[str], list[str], list[str]]:
    """Start `deferral standalone` (no --run); its `export` lines and all it printed, once it
    says it runs."""
    proc = subprocess.Popen(
        command("deferral", "standalone", "--home", str(home), "--dags-folder", str(EXAMPLES)),
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=stderr,
        text=True,
    )
    stdout = proc.stdout
    assert stdout is not None
    lines: queue.Queue[str] = queue.Queue()

    def read() -> None:
        for line in stdout:
            lines.put(line)

    threading.Thread(target=read, daemon=True).start()
    exports: list[str] = []
    said: list[str] = []
    deadline = time.monotonic() + 180
    while True:  # the services write to stderr; stdout says when everything runs
        try:
            line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            proc.kill()
            raise AssertionError(f"standalone did not say it runs; printed {exports}") from None
        said.append(line.rstrip("\n"))
        if line.startswith("export "):
            exports.append(line.rstrip("\n"))
        if line.startswith("services running"):
            break
    return proc, exports, said


def _stop(proc: subprocess.Popen[str]) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()


def test_standalone_prints_what_another_terminal_needs_keeps_its_ports_and_stops_whole(
    tmp_path: Path, workdir: Path
) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DEFERRAL_")}
    home, elsewhere = workdir / ".deferral", tmp_path / "elsewhere"
    elsewhere.mkdir()
    proc, exports, said = _start(home, tmp_path, env)
    try:
        names = [line.split("=", 1)[0] for line in exports]
        assert names == [
            "export DEFERRAL_DATABASE_URL",
            "export DEFERRAL_REDIS_URL",
            "export DEFERRAL_FERNET_KEY",
            "export DEFERRAL_DAGS_FOLDER",
        ]
        key = (home / "fernet.key").read_text().strip()
        assert not any(key in line for line in exports)  # read from its file by the shell
        # The web UI answers at the address it printed; its admin password stays in its file.
        web_port = int((home / "webserver.port").read_text())
        assert f"# web UI: http://127.0.0.1:{web_port}/" in said
        password = (home / "webserver-admin.password").read_text().strip()
        assert not any(password in line for line in said)
        wait_for(
            lambda: "example_deferrable" in _listed_dags(web_port),
            timeout=90,
            what="the web UI to list the DAG its scheduler parsed",
        )
        # Another terminal, in another directory, with nothing but those lines.
        script = "\n".join(
            [
                *exports,
                # (with no wait beyond the deferral itself: the example's default only adds time)
                f"{shlex.join(command('deferral'))} dags trigger example_deferrable --wait"
                " --conf '{\"wait_seconds\": 0}'",
            ]
        )
        other = subprocess.run(
            ["bash", "-c", script + " --timeout 120"],
            cwd=elsewhere,
            env=env,
            capture_output=True,
            text=True,
            timeout=200,
        )
        assert other.returncode == 0, other.stdout + other.stderr
        assert other.stdout.splitlines()[-1].endswith(": success")
    finally:
        _stop(proc)
    port = (home / "redis.port").read_text().strip()
    assert f"export DEFERRAL_REDIS_URL=redis://127.0.0.1:{port}/0" in exports
    # Started again on the same home (the next test's stack): the same servers at the same
    # places.
    _one_stack_per_home_and_a_dead_service_stops_the_stack(tmp_path, home, env, exports)


def _processes_naming(text: str) -> list[str]:
    """Command lines of the live processes that mention ``text``."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if text in cmdline and proc.name != str(os.getpid()):
            found.append(cmdline)
    return found


def _one_stack_per_home_and_a_dead_service_stops_the_stack(
    tmp_path: Path, home: Path, env: dict[str, str], exports: list[str]
) -> None:
    errors = tmp_path / "stderr"
    with errors.open("w") as stderr:
        proc, exports_again, said = _start(home, tmp_path, env, stderr)
    try:
        assert exports_again == exports
        # The first line says what was started and where its data lives.
        assert said[0].startswith("# deferral standalone: embedded PostgreSQL (data in ")
        assert "embedded Redis on 127.0.0.1:" in said[0]
        second = subprocess.run(
            command("deferral", "standalone", "--home", str(home), "--dags-folder", str(EXAMPLES)),
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert second.returncode == 1
        assert f"another deferral standalone (pid {proc.pid}) runs on {home}" in second.stderr
        assert "XDG_RUNTIME_DIR" not in second.stderr
        # `dags test` on the same home is refused before it starts a server: no second Redis
        # moves the kept port the export lines name.
        redis_port = (home / "redis.port").read_text()
        tested = subprocess.run(
            command("deferral", "dags", "test", "example_deferrable", "--home", str(home)),
            cwd=tmp_path,
            env={**env, "DEFERRAL_DAGS_FOLDER": str(EXAMPLES)},
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert tested.returncode == 1
        assert f"error: another deferral standalone (pid {proc.pid}) runs on {home}" in (
            tested.stderr
        )
        assert "`deferral dags trigger DAG_ID --wait`" in tested.stderr
        assert (home / "redis.port").read_text() == redis_port
        # A service that dies takes the stack down, saying which.
        scheduler = subprocess.run(
            ["pgrep", "-P", str(proc.pid), "-f", "scheduler consume"],
            capture_output=True,
            text=True,
        ).stdout.split()
        assert len(scheduler) == 1, scheduler
        os.kill(int(scheduler[0]), signal.SIGKILL)
        assert proc.wait(timeout=120) == 1
        assert "error: the scheduler service exited (exit code -9); stopped the others" in (
            errors.read_text()
        )
    finally:
        if proc.poll() is None:
            proc.kill()
    # Nothing of the stack is left: its Redis and its PostgreSQL stopped with it.
    servers = (f"--port {(home / 'redis.port').read_text().strip()} ", str(home / "pgdata"))
    deadline = time.monotonic() + 60
    while (left := [line for text in servers for line in _processes_naming(text)]) and (
        time.monotonic() < deadline
    ):
        time.sleep(0.2)
    assert left == []


def _listed_dags(web_port: int) -> set[str]:
    with urllib.request.urlopen(f"http://127.0.0.1:{web_port}/api/v1/dags", timeout=30) as web:
        return {d["dag_id"] for d in json.load(web)["dags"]}
