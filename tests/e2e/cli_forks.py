"""The ``deferral`` CLI for the end-to-end tests, run in a process forked from one that has
imported it already: each command is still a process of its own (its environment, working
directory, exit status, stdout and stderr; nothing of one command is left for the next), without
the second or more, on a loaded 2-core machine, that each start of Python spends importing.

``python -m tests.e2e.cli_forks`` is the forking side: it imports ``deferral_cli`` once, then
reads one request per line on stdin (JSON: argv, env, cwd, and the files for stdout and stderr),
forks a child that runs the command as the console script does, and answers ``pid N`` at once
and ``exit N`` when the child ends. ``CliForks`` is the tests' side."""

from __future__ import annotations

import atexit
import json
import locale
import os
import select
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

SCRIPT = Path(sys.executable).parent / "deferral"


def _exit_status(code: object) -> int:
    """The exit status of ``sys.exit(code)``, as the interpreter gives it."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    sys.stderr.write(f"{code}\n")
    return 1


def _run_child(request: dict[str, Any]) -> None:
    """In the forked child: become the command's process, run it, and exit with its status."""
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
        target = os.open(path, os.O_WRONLY | os.O_TRUNC)
        os.dup2(target, fd)
        os.close(target)
    sys.argv = [str(SCRIPT), *request["argv"]]
    from deferral_cli import main

    try:
        main()
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
    """The forking side: one command at a time, as the tests ask."""
    import deferral_cli  # noqa: F401  (imported once, here, for every child)

    answers = sys.stdout
    for line in sys.stdin:
        request = json.loads(line)
        answers.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            _run_child(request)
        answers.write(f"pid {pid}\n")
        answers.flush()
        _, status = os.waitpid(pid, 0)
        answers.write(f"exit {os.waitstatus_to_exitcode(status)}\n")
        answers.flush()


class CliForks:
    """Runs ``deferral`` commands through a ``python -m tests.e2e.cli_forks`` process of its
    own (started at the first command, stopped by ``close``)."""

    def __init__(self) -> None:
        self._server: subprocess.Popen[bytes] | None = None
        self._unread = b""  # what the forking side answered beyond the last line read

    def start(self) -> subprocess.Popen[bytes]:
        """The forking process, started if it is not running."""
        if self._server is None or self._server.poll() is not None:
            self._server = subprocess.Popen(
                [sys.executable, "-m", "tests.e2e.cli_forks"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                cwd=Path(__file__).resolve().parents[2],
            )
            self._unread = b""
        return self._server

    def run(
        self, args: list[str], env: dict[str, str], timeout: float, cwd: Path | None = None
    ) -> subprocess.CompletedProcess[str]:
        """Like ``subprocess.run([deferral, *args], env=env, cwd=cwd, capture_output=True,
        text=True, timeout=timeout)``."""
        server = self.start()
        assert server.stdin is not None and server.stdout is not None
        with tempfile.TemporaryDirectory(prefix="deferral-cli-") as home:
            out, err = Path(home) / "stdout", Path(home) / "stderr"
            out.touch()
            err.touch()
            request = {"argv": args, "env": env, "cwd": str(cwd or os.getcwd())}
            line = json.dumps({**request, "stdout": str(out), "stderr": str(err)}) + "\n"
            server.stdin.write(line.encode())
            server.stdin.flush()
            pid = int(self._answer("pid", timeout=60))
            try:
                status = int(self._answer("exit", timeout=timeout))
            except subprocess.TimeoutExpired:
                os.kill(pid, 9)
                self._answer("exit", timeout=60)
                raise subprocess.TimeoutExpired([str(SCRIPT), *args], timeout) from None
            return subprocess.CompletedProcess([str(SCRIPT), *args], status, _text(out), _text(err))

    def _answer(self, word: str, timeout: float) -> str:
        """The value of the forking side's next answer, which must be ``word``."""
        assert self._server is not None and self._server.stdout is not None
        answers = self._server.stdout.fileno()
        deadline = time.monotonic() + timeout
        while b"\n" not in self._unread:
            ready, _, _ = select.select([answers], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                raise subprocess.TimeoutExpired(word, timeout)
            chunk = os.read(answers, 4096)
            assert chunk, "the CLI forking process ended"
            self._unread += chunk
        line, self._unread = self._unread.split(b"\n", 1)
        said, _, value = line.decode().partition(" ")
        assert said == word, f"the CLI forking process answered {line!r}, not {word}"
        return value

    def close(self) -> None:
        if self._server is not None and self._server.poll() is None:
            assert self._server.stdin is not None
            self._server.stdin.close()
            self._server.wait(timeout=30)


def _text(path: Path) -> str:
    """A command's output as ``subprocess.run(..., text=True)`` decodes it."""
    decoded = path.read_bytes().decode(locale.getpreferredencoding(False))
    return decoded.replace("\r\n", "\n").replace("\r", "\n")


if __name__ == "__main__":
    serve()
