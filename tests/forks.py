"""The tests' processes (``deferral`` CLI commands, and the end-to-end tests' ``scheduler``,
``triggerer`` and ``worker consume``), each forked from one process per lane that has imported
them already. Each is still a process of its own, started as its console script would be (its
argv, environment, working directory, stdout and stderr; its own pid, to kill -9 or SIGSTOP; its
exit status), and nothing of one is left for the next: only the interpreter start and the
imports, about a second of CPU each on a loaded 2-core machine, are paid once per lane instead
of once per process. (The README's demo, the compose-as-processes test and the standalone tests
start real interpreters.)

``python -u -m tests.forks`` is the forking side: it imports the console scripts' modules
once, then reads one request per line on stdin (JSON: an id, the entry point, argv, env, cwd,
the files for stdout and stderr), forks a child that runs it as the console script does, and
answers ``pid ID PID`` at once and ``exit PID STATUS`` whenever a child ends. ``Forks`` is the
tests' side; ``ForkedProcess`` answers like the ``subprocess.Popen`` of the same command."""

from __future__ import annotations

import atexit
import contextlib
import importlib
import json
import locale
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
import traceback
import types
from pathlib import Path
from typing import Any

BIN = Path(sys.executable).parent

# Console script -> entry point (pyproject.toml's [project.scripts]), and what its command
# imports late, so that a child imports nothing.
ENTRY_POINTS = {
    "deferral": "deferral_cli:main",
    "scheduler": "scheduler.cli:main",
    "triggerer": "triggerer.cli:main",
    "worker": "worker.cli:main",
}
PRELOAD = ("scheduler.service", "triggerer.service", "worker.service")


def _exit_status(code: object) -> int:
    """The exit status of ``sys.exit(code)``, as the interpreter gives it."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    sys.stderr.write(f"{code}\n")
    return 1


def _run_child(request: dict[str, Any], wake: tuple[int, int]) -> None:
    """In the forked child: become the command's process, run it, and exit with its status."""
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    for fd in wake:
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    mode = os.O_WRONLY | (os.O_APPEND if request["append"] else os.O_TRUNC)
    for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
        target = os.open(path, mode)
        os.dup2(target, fd)
        os.close(target)
    script = str(BIN / request["script"])
    sys.argv = [script, *request["argv"]]
    # __main__ as the console script's (a worker's task processes, spawned, import it again).
    main_module = types.ModuleType("__main__")
    main_module.__file__ = script
    sys.modules["__main__"] = main_module
    module, _, function = ENTRY_POINTS[request["script"]].partition(":")
    try:
        getattr(importlib.import_module(module), function)()
        status = 0
    except SystemExit as exc:
        status = _exit_status(exc.code)
    except BaseException:
        traceback.print_exc()
        status = 1
    atexit._run_exitfuncs()  # what the interpreter runs at its exit (logging's flush, ...)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def serve() -> None:
    """The forking side: forks on each request, reports each child's end (SIGCHLD wakes it)."""
    for module in (*{e.partition(":")[0] for e in ENTRY_POINTS.values()}, *PRELOAD):
        importlib.import_module(module)
    wake = os.pipe()
    os.set_blocking(wake[1], False)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.set_wakeup_fd(wake[1])
    answers = sys.stdout
    unread = b""
    while True:
        with contextlib.suppress(InterruptedError):
            ready, _, _ = select.select([0, wake[0]], [], [])
        if wake[0] in ready:
            os.read(wake[0], 4096)
        while True:  # reap every child that ended
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            answers.write(f"exit {pid} {os.waitstatus_to_exitcode(status)}\n")
        if 0 in ready:
            chunk = os.read(0, 65536)
            if not chunk:
                return
            unread += chunk
            *lines, unread = unread.split(b"\n")
            for line in lines:
                request = json.loads(line)
                answers.flush()
                sys.stderr.flush()
                pid = os.fork()
                if pid == 0:
                    _run_child(request, wake)
                answers.write(f"pid {request['id']} {pid}\n")
        answers.flush()


class Forks:
    """Starts processes through a ``python -m tests.forks`` process of its own (started at the
    first request, stopped by ``close``)."""

    def __init__(self) -> None:
        self._server: subprocess.Popen[bytes] | None = None
        self._lock = threading.Lock()  # one request written at a time
        self._changed = threading.Condition()
        self._pids: dict[int, int] = {}  # request id -> pid
        self._exits: dict[int, int] = {}  # pid -> exit status
        self._requests = 0

    def start(self) -> subprocess.Popen[bytes]:
        """The forking process, started if it is not running."""
        if self._server is None or self._server.poll() is not None:
            self._server = subprocess.Popen(
                [sys.executable, "-u", "-m", "tests.forks"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                cwd=Path(__file__).resolve().parents[1],
            )
            threading.Thread(target=self._read_answers, args=(self._server,), daemon=True).start()
        return self._server

    def _read_answers(self, server: subprocess.Popen[bytes]) -> None:
        assert server.stdout is not None
        for line in server.stdout:
            said, first, second = line.decode().split()
            with self._changed:
                if said == "pid":
                    self._pids[int(first)] = int(second)
                    self._exits.pop(int(second), None)  # an earlier process's, with this pid
                else:
                    self._exits[int(first)] = int(second)
                self._changed.notify_all()

    def spawn(
        self, script: str, argv: list[str], env: dict[str, str], cwd: Path | None, output: Path
    ) -> ForkedProcess:
        """Start the console script ``script`` with ``argv`` and exactly ``env``, its stdout and
        stderr appended to ``output``."""
        return self._fork(script, argv, env, cwd, output, output, append=True)

    def _fork(
        self,
        script: str,
        argv: list[str],
        env: dict[str, str],
        cwd: Path | None,
        stdout: Path,
        stderr: Path,
        append: bool,
    ) -> ForkedProcess:
        for path in (stdout, stderr):
            path.touch()
        with self._lock:
            server = self.start()
            assert server.stdin is not None
            self._requests += 1
            request = {
                "id": self._requests,
                "script": script,
                "argv": argv,
                "env": env,
                "cwd": str(cwd or os.getcwd()),
                "stdout": str(stdout),
                "stderr": str(stderr),
                "append": append,
            }
            server.stdin.write(json.dumps(request).encode() + b"\n")
            server.stdin.flush()
            ident = self._requests
        with self._changed:
            if not self._changed.wait_for(lambda: ident in self._pids, timeout=120):
                raise RuntimeError("the forking process did not answer in 120 s")
            pid = self._pids.pop(ident)
        return ForkedProcess(self, pid, [str(BIN / script), *argv])

    def run(
        self,
        args: list[str],
        env: dict[str, str],
        timeout: float,
        cwd: Path | None = None,
        script: str = "deferral",
    ) -> subprocess.CompletedProcess[str]:
        """Like ``subprocess.run([script, *args], env=env, cwd=cwd, capture_output=True,
        text=True, timeout=timeout)``."""
        with tempfile.TemporaryDirectory(prefix="deferral-cli-") as home:
            out, err = Path(home) / "stdout", Path(home) / "stderr"
            proc = self._fork(script, args, env, cwd, out, err, append=False)
            try:
                status = proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(60)
                raise
            return subprocess.CompletedProcess(proc.args, status, _text(out), _text(err))

    def exit_status(self, pid: int, timeout: float | None) -> int | None:
        """The exit status of ``pid``, waiting up to ``timeout`` seconds (None: no limit) for it;
        None if it is still running then."""
        with self._changed:
            self._changed.wait_for(lambda: pid in self._exits, timeout=timeout)
            return self._exits.get(pid)

    def close(self) -> None:
        if self._server is not None and self._server.poll() is None:
            assert self._server.stdin is not None
            self._server.stdin.close()
            self._server.wait(timeout=30)


class ForkedProcess:
    """A forked process, answering as ``subprocess.Popen`` does for what the tests use."""

    def __init__(self, forks: Forks, pid: int, args: list[str]) -> None:
        self._forks = forks
        self.pid = pid
        self.args = args

    @property
    def returncode(self) -> int | None:
        return self._forks.exit_status(self.pid, timeout=0)

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        status = self._forks.exit_status(self.pid, timeout)
        if status is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0)
        return status

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:  # not reaped, so the pid is still this process's
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


# This lane's forking process (tests/conftest.py stops it at the session's end).
LANE = Forks()


def _text(path: Path) -> str:
    """A command's output as ``subprocess.run(..., text=True)`` decodes it."""
    decoded = path.read_bytes().decode(locale.getpreferredencoding(False))
    return decoded.replace("\r\n", "\n").replace("\r", "\n")


if __name__ == "__main__":
    serve()
