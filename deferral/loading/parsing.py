"""Reading the DAGs folder without ever stopping the process that needs its DAGs.

A file whose import never finishes must cost an import error, not the loop that reads it: a
*parse child* (a fork of this process, so it starts in milliseconds with everything imported)
imports each new or changed file first, each within ``DEFERRAL_DAGBAG_IMPORT_TIMEOUT`` (a
SIGALRM in the child, as Airflow's DagBag does; a child that does not answer by then is killed).
This process then imports, in a thread of its own, only the files that finished in time, so
that it holds the DAG objects it evaluates runs with; what failed in the child is its import
error without being imported again here. The caller's loop reads the last finished parse.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import logging
import os
import select
import signal
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from deferral.dag import DAG
from deferral.loading.dagbag import DagBag, timeout_message
from deferral.store import metastore

log = logging.getLogger("deferral.loading.parsing")

# What a child killed for a file that ignored its alarm has on top of the timeout to answer.
KILL_GRACE_SEC = 5.0


@dataclass(frozen=True)
class Parsed:
    """One read of the folder: the DAGs by id and the import errors by file, as of
    ``started_at`` (a run created before it whose DAG is not there is missing for sure)."""

    started_at: dt.datetime
    dags: dict[str, DAG]
    import_errors: dict[str, str]


class FolderParser:
    """Reads ``bag``'s folder, each new or changed file first in a parse child within
    ``timeout`` seconds; ``parse`` in the calling thread, ``start`` in a thread of its own
    whose result ``take`` (or ``wait``) hands over once."""

    def __init__(self, bag: DagBag, timeout: float) -> None:
        self.bag = bag
        self.timeout = timeout
        self._lock = threading.Lock()  # one parse at a time: a DagBag is not thread-safe
        self._thread: threading.Thread | None = None
        self._done = threading.Event()
        self._result: Parsed | None = None
        self._child: int | None = None
        self._closed = False  # the process is stopping: no more parse children
        self._forking = threading.Lock()

    def parse(self) -> Parsed:
        started_at = dt.datetime.now(dt.UTC)
        with self._lock:
            failed = self._probe(self.bag.stale_sources()) if self.timeout else {}
            if not self._closed:  # stopping: what the child did not vouch for stays unread
                self.bag.collect(known=failed)
            return Parsed(started_at, dict(self.bag.dags), dict(self.bag.import_errors))

    def start(self) -> None:
        """Begin a parse in the background, unless one is under way."""
        if self._closed or (self._thread is not None and self._thread.is_alive()):
            return
        self._done.clear()
        self._thread = threading.Thread(target=self._parse_in_background, daemon=True)
        self._thread.name = "dag-parse"
        self._thread.start()

    def take(self) -> Parsed | None:
        """The background parse that finished since the last take, if one did."""
        if not self._done.is_set():
            return None
        self._done.clear()
        result, self._result = self._result, None
        return result

    def wait(self, timeout: float) -> bool:
        """Whether a finished background parse awaits ``take``, after waiting up to
        ``timeout`` seconds for the one under way."""
        return self._done.wait(timeout)

    def close(self) -> None:
        """Kill a parse child still at work, and fork no other (this process is stopping)."""
        with self._forking:
            self._closed = True
            child = self._child
        if child is not None:
            _kill(child)

    def _parse_in_background(self) -> None:
        try:
            self._result = self.parse()
        except Exception:
            log.exception("reading the DAGs folder %s failed", self.bag.folder)
            self._result = None
        self._done.set()

    def _probe(self, paths: Sequence[Path]) -> dict[str, tuple[float, str]]:
        """(mtime, error) of each of ``paths`` that fails to import in a parse child, a file
        past the timeout included; a child killed on a file goes on in a new one after it."""
        failed: dict[str, tuple[float, str]] = {}
        left = list(paths)
        while left and not self._closed:
            done, stuck = self._probe_in_child(left)
            for name, (mtime, error) in done.items():
                if error is not None:
                    failed[name] = (mtime, error)
            if stuck is None:
                break
            path, reason = stuck
            with contextlib.suppress(OSError):
                failed[str(path)] = (path.stat().st_mtime, reason)
            left = left[left.index(path) + 1 :]
        return failed

    def _probe_in_child(
        self, paths: Sequence[Path]
    ) -> tuple[dict[str, tuple[float, str | None]], tuple[Path, str] | None]:
        """What a new parse child said of ``paths``, and the file it stopped on (killed past
        the timeout, or exited) with the reason, if it did not finish them."""
        with self._forking:  # close() either sees this child or keeps it from being forked
            if self._closed:
                return {}, None
            read_end, write_end = os.pipe()
            pid = os.fork()
            if pid == 0:  # pragma: no cover (the child ends with os._exit)
                os.close(read_end)
                _probe_and_exit(self.bag, self.timeout, paths, write_end)
            os.close(write_end)
            self._child = pid
        done: dict[str, tuple[float, str | None]] = {}
        current: Path | None = None
        try:
            for message in _messages(read_end, self.timeout + KILL_GRACE_SEC):
                if message is None:  # no word within the file's time: it never finishes
                    _kill(pid)
                    if current is None:  # stuck before any file: the policy module, say
                        raise RuntimeError(f"the parse child did not start on {paths[0]}")
                    return done, (current, timeout_message(self.timeout))
                if message[0] == "start":
                    current = Path(message[1])
                else:
                    _, path, mtime, error = message
                    done[path] = (mtime, error)
                    current = None
        finally:
            os.close(read_end)
            status = _reap(pid)
            self._child = None
        if current is not None:
            return done, (current, f"the parse child exited ({status}) importing the file")
        return done, None


def _probe_and_exit(bag: DagBag, timeout: float, paths: Sequence[Path], fd: int) -> None:
    """The parse child: import each of ``paths`` within ``timeout`` and say how it went, one
    JSON line before and one after each file. Never returns."""
    try:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        # A DAG file reading a Variable opens connections of its own, never the parent's.
        metastore.forget_connections()
        out = os.fdopen(fd, "w", buffering=1)
        bag.import_timeout = timeout

        def starting(path: Path) -> None:
            out.write(json.dumps(["start", str(path)]) + "\n")

        for path, mtime, error in bag.probe(paths, starting):
            out.write(json.dumps(["done", str(path), mtime, error]) + "\n")
        out.flush()
    except BaseException:
        log.exception("the parse child failed")
    finally:
        os._exit(0)


def _messages(fd: int, patience: float) -> Iterator[list[Any] | None]:
    """The child's JSON lines as they come; None when none came for ``patience`` seconds."""
    pending = b""
    while True:
        deadline = time.monotonic() + patience
        while b"\n" not in pending:
            left = deadline - time.monotonic()
            ready, _, _ = select.select([fd], [], [], max(left, 0))
            if not ready:
                yield None
                return
            chunk = os.read(fd, 65536)
            if not chunk:
                return
            pending += chunk
        line, pending = pending.split(b"\n", 1)
        yield json.loads(line)


def _kill(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


def _reap(pid: int) -> str:
    try:
        _, status = os.waitpid(pid, 0)
    except ChildProcessError:
        return "already reaped"
    code = os.waitstatus_to_exitcode(status)
    return f"signal {-code}" if code < 0 else f"status {code}"
