"""Reading the DAGs folder without ever stopping the process that needs its DAGs.

A file whose import never finishes must cost an import error, not the loop that reads it: a
*parse child* (a fork of this process, so it starts in milliseconds with everything imported)
imports each new or changed file first, each within ``DEFERRAL_DAGBAG_IMPORT_TIMEOUT`` (a
SIGALRM in the child, as Airflow's DagBag does; a child that does not answer by then is killed).
This process then imports, in a thread of its own, only the files that finished in time, so
that it holds the DAG objects it evaluates runs with; what failed in the child is its import
error without being imported again here. The caller's loop reads the last finished parse. A
file slow to import is left to its child while others read the files after it, and the read
hands over what it has meanwhile (an interim read), so one slow file holds back no other.
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
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from deferral.dag import DAG
from deferral.loading.dagbag import DagBag, dag_sources, source_mtimes, source_of, timeout_message
from deferral.store import metastore

log = logging.getLogger("deferral.loading.parsing")

# What a child killed for a file that ignored its alarm has on top of the timeout to answer.
KILL_GRACE_SEC = 5.0
# A file the child has been on this long makes a background read hand over what it has so far
# (an interim read: the files still to come keep what the last read gave), so one slow file
# does not hold back the DAGs of every file after it for the whole timeout.
INTERIM_AFTER_SEC = 1.0


@dataclass(frozen=True)
class Parsed:
    """One read of the folder: the DAGs by id and the import errors by file, as of
    ``started_at`` (a run created before it whose DAG is not there is missing for sure, unless
    the read is interim). ``pending``: the files an interim read has not read yet (their DAGs
    are the last read's, if it had them)."""

    started_at: dt.datetime
    dags: dict[str, DAG]
    import_errors: dict[str, str]
    pending: frozenset[str] = frozenset()
    # The DAG files and archives the read listed, with their mtimes then (``settled``).
    listed: Mapping[str, float] = field(default_factory=dict)


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
        self._handing = threading.Lock()  # a read handed over is never lost to a take
        self._children: set[int] = set()
        self._closed = False  # the process is stopping: no more parse children
        self._forking = threading.Lock()

    def parse(self) -> Parsed:
        return self._parse(interim=False)

    def _parse(self, *, interim: bool) -> Parsed:
        """A read of the folder; with ``interim``, a read held up by a slow file hands over
        interim reads meanwhile (``take``)."""
        started_at = dt.datetime.now(dt.UTC)
        with self._lock:
            failed: dict[str, tuple[float, str]] = {}

            def hand_over(slow: Path) -> None:
                pending = [slow, *(path for path in stale if str(path) not in probe.read)]
                self._hand_over(self._read(started_at, failed, pending))

            stale = self.bag.stale_sources()
            probe = _Probe(set(), failed, hand_over if interim else None)
            if self.timeout:
                self._probe(stale, probe)
            if self._closed:  # stopping: what the child did not vouch for stays unread
                return self._read(started_at, failed, self.bag.stale_sources())
            return self._read(started_at, failed, ())

    def parse_file(self, path: Path) -> Parsed:
        """A read of the one DAG file or archive ``path`` of the folder, in the calling thread:
        first in a parse child within the timeout, then here if it finished in time; no other
        file of the folder is imported or read."""
        started_at = dt.datetime.now(dt.UTC)
        with self._lock:
            failed: dict[str, tuple[float, str]] = {}
            if self.timeout:
                self._probe([path], _Probe(set(), failed, None))
            if str(path) not in failed:
                self.bag.collect_file(path)
            errors = {**self.bag.import_errors, **{p: e for p, (_, e) in failed.items()}}
            return Parsed(started_at, dict(self.bag.dags), errors, listed=dict(self.bag.listed))

    def _read(
        self, started_at: dt.datetime, failed: dict[str, tuple[float, str]], pending: Sequence[Path]
    ) -> Parsed:
        self.bag.collect(known=failed, pending=pending)
        return Parsed(
            started_at,
            dict(self.bag.dags),
            dict(self.bag.import_errors),
            frozenset(str(path) for path in pending),
            dict(self.bag.listed),
        )

    def start(self) -> bool:
        """Begin a parse in the background, unless one is under way; whether this began one."""
        if self._closed or (self._thread is not None and self._thread.is_alive()):
            return False
        self._done.clear()
        self._thread = threading.Thread(target=self._parse_in_background, daemon=True)
        self._thread.name = "dag-parse"
        self._thread.start()
        return True

    def take(self) -> Parsed | None:
        """The background parse that finished since the last take, if one did."""
        with self._handing:
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
            children = list(self._children)
        for child in children:
            _kill(child)

    def _parse_in_background(self) -> None:
        try:
            self._hand_over(self._parse(interim=True))
        except Exception:
            log.exception("reading the DAGs folder %s failed", self.bag.folder)
            self._hand_over(None)

    def settled(self, parsed: Parsed) -> Parsed:
        """``parsed`` as it may be recorded: the files added, changed or removed since it
        listed the folder are pending (what was recorded of them stays), so a read that began
        before another replica's, or before a file was written, never undoes what a newer read
        recorded (DECISIONS.md 106). Files are compared by their mtime as listed, not by a
        clock: a file written just before the read is its own, one with an mtime ahead of the
        clock is read as it is."""
        folder = self.bag.folder
        now = source_mtimes(dag_sources(folder, self.bag.ignore_syntax) if folder.is_dir() else [])
        changed = {
            path
            for path in now.keys() | parsed.listed.keys()
            if now.get(path) != parsed.listed.get(path)
        }
        if not changed:
            return parsed
        return Parsed(
            parsed.started_at,
            {
                dag_id: dag
                for dag_id, dag in parsed.dags.items()
                if not dag.fileloc or str(source_of(Path(dag.fileloc))) not in changed
            },
            {path: error for path, error in parsed.import_errors.items() if path not in changed},
            parsed.pending | changed,
            parsed.listed,
        )

    def _hand_over(self, parsed: Parsed | None) -> None:
        with self._handing:
            self._result = parsed
            self._done.set()

    def _probe(self, paths: Sequence[Path], probe: _Probe) -> None:
        """Read ``paths`` in parse children into ``probe``: a child killed on a file goes on in
        a new one after it."""
        left = [path for path in paths if str(path) not in probe.read]
        while left and not self._closed:
            stuck = self._probe_in_child(left, probe)
            if stuck is None:
                break
            path, reason = stuck
            probe.read.add(str(path))
            with contextlib.suppress(OSError):
                probe.failed[str(path)] = (path.stat().st_mtime, reason)
            left = [later for later in left[left.index(path) + 1 :] if str(later) not in probe.read]

    def _probe_in_child(self, paths: Sequence[Path], probe: _Probe) -> tuple[Path, str] | None:
        """Read ``paths`` in a new parse child into ``probe``; the file it stopped on (killed
        past the timeout, or exited) with the reason, if it did not finish them. A file slow to
        import (INTERIM_AFTER_SEC) is left to this child while the files after it are read by
        others meanwhile, and a background read hands over what it has then."""
        with self._forking:  # close() either sees this child or keeps it from being forked
            if self._closed:
                return None
            read_end, write_end = os.pipe()
            pid = os.fork()
            if pid == 0:  # pragma: no cover (the child ends with os._exit)
                os.close(read_end)
                _probe_and_exit(self.bag, self.timeout, paths, write_end)
            os.close(write_end)
            self._children.add(pid)
        current: Path | None = None
        slow: Path | None = None  # the file this child was left alone with
        patience = self.timeout + KILL_GRACE_SEC
        try:
            for message in _messages(read_end, patience, INTERIM_AFTER_SEC):
                if message == _SLOW:
                    if current is not None and slow is None:
                        slow = current
                        self._probe(paths[paths.index(slow) + 1 :], probe)
                        probe.slow(slow)
                    continue
                if message is None:  # no word within the file's time: it never finishes
                    _kill(pid)
                    if current is None:  # stuck before any file: the policy module, say
                        raise RuntimeError(f"the parse child did not start on {paths[0]}")
                    return current, timeout_message(self.timeout)
                if message[0] == "start":
                    current = Path(message[1])
                    continue
                _, path, mtime, error = message
                probe.read.add(path)
                if error is not None:
                    probe.failed[path] = (mtime, error)
                current = None
                if slow is not None:  # what came after it was read meanwhile
                    _kill(pid)
                    return None
        finally:
            os.close(read_end)
            status = _reap(pid)
            self._children.discard(pid)
        if current is not None:
            return current, f"the parse child exited ({status}) importing the file"
        return None


@dataclass
class _Probe:
    """What the parse children of one read found: the files read, those that failed (mtime,
    error), and what to do once when a file is slow (a background read's interim read)."""

    read: set[str]
    failed: dict[str, tuple[float, str]]
    on_slow: Callable[[Path], None] | None

    def slow(self, path: Path) -> None:
        on_slow, self.on_slow = self.on_slow, None
        if on_slow is not None:
            on_slow(path)


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


# Said by _messages when a line is slow to come.
_SLOW: list[Any] = ["slow"]


def _messages(fd: int, patience: float, slow_after: float) -> Iterator[list[Any] | None]:
    """The child's JSON lines as they come; _SLOW once when one has not come for
    ``slow_after`` seconds; None (the end) when none came for ``patience`` seconds."""
    pending = b""
    while True:
        began = time.monotonic()
        slow_said = False
        while b"\n" not in pending:
            waited = time.monotonic() - began
            if not slow_said and waited >= slow_after:
                slow_said = True
                yield _SLOW
            wait = (patience if slow_said else min(patience, slow_after)) - waited
            ready, _, _ = select.select([fd], [], [], max(wait, 0))
            if ready:
                chunk = os.read(fd, 65536)
                if not chunk:
                    return
                pending += chunk
            elif slow_said or slow_after >= patience:
                yield None
                return
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
