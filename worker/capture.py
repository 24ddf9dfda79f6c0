"""What a task attempt writes, captured in its child process into the try's task log.

For the length of the attempt, file descriptors 1 and 2 of the child point at one pipe (as
``2>&1`` does), so ``print``, ``logging`` (a handler on the root logger, writing to stderr) and the
output of subprocesses and C code arrive in the order they were written. One thread reads the
pipe and writes what it read in batches (every half second, or sooner when it grows), while the
enlarged pipe holds what the task writes meanwhile, so the task never waits for the database
(one thread, not a reader and a writer: starting threads was a tenth of a worker's CPU at
hundreds of attempts a second). When the attempt ends, the
descriptors are restored, what is left in the pipe is read and the last batch is written before
the outcome goes to the worker, which commits it only then: a finished try's log is complete.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import fcntl
import logging
import os
import select
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import TextIO

from deferral import tasklogs
from deferral.metastore import metastore
from deferral.tasklogs import LOG_FORMAT, SOURCE_TASK, NewLine
from worker.attempt import execute_attempt
from worker.outcomes import AttemptRequest, Outcome

log = logging.getLogger("deferral.worker.capture")

FLUSH_INTERVAL_SEC = 0.5
# The reader takes what the pipe holds this often, not at every write: waking per line would
# contend with the task for the GIL (measured: a task printing 200,000 lines took 5 s instead
# of 1 s). The pipe is enlarged so that the task does not wait in between.
READ_PAUSE_SEC = 0.02
PIPE_BYTES = 1024 * 1024
BATCH_LINES = 1000
# A longer run of bytes without a newline is stored as several lines.
MAX_LINE_BYTES = 64 * 1024

Writer = Callable[[Sequence[NewLine]], None]


class TaskOutput:
    """Captures fds 1 and 2 of this process into ``write`` (batches of lines of one try) while
    it is entered. At most about ``max_bytes`` wait in memory: the try's log is cut there
    anyway, and one line past it is kept so that the store writes the cut marker."""

    def __init__(self, task_instance_id: int, try_number: int, write: Writer, max_bytes: int):
        self.task_instance_id = task_instance_id
        self.try_number = try_number
        self.write = write
        self.max_bytes = max_bytes
        self._queued: list[NewLine] = []
        self._queued_bytes = 0  # of this attempt, written or not
        self._lock = threading.Lock()
        self._ending = threading.Event()
        self._written_at = 0.0

    def __enter__(self) -> TaskOutput:
        _flush_std()
        read_end, write_end = os.pipe()
        with contextlib.suppress(OSError, AttributeError):  # Linux only; a smaller limit
            fcntl.fcntl(write_end, fcntl.F_SETPIPE_SZ, PIPE_BYTES)
        self._read_end = read_end
        self._saved = (os.dup(1), os.dup(2))
        os.dup2(write_end, 1)
        os.dup2(write_end, 2)
        os.close(write_end)
        # Line-buffered streams on the pipe (Python's own would be block-buffered there, and
        # print() would come after later log lines); whatever stood in for them comes back after.
        self._streams = (sys.stdout, sys.stderr)
        sys.stdout, sys.stderr = _line_stream(1), _line_stream(2)
        self._handler = logging.StreamHandler(sys.stderr)
        self._handler.setFormatter(logging.Formatter(LOG_FORMAT))
        root = logging.getLogger()
        self._root_level = root.level
        root.addHandler(self._handler)
        # Only when it differs: every setLevel clears the cache of every logger of the process
        # (a few percent of a worker's CPU at hundreds of attempts a second).
        if root.level != logging.INFO:
            root.setLevel(logging.INFO)
        self._written_at = time.monotonic()
        self._reader = threading.Thread(target=self._read, name="task-output", daemon=True)
        self._reader.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        # Our streams are left open (they do not own the fds): a thread the task left behind
        # may still write to them, and then writes where fds 1 and 2 point again.
        _flush_std()
        root = logging.getLogger()
        root.removeHandler(self._handler)
        if root.level != self._root_level:
            root.setLevel(self._root_level)
        sys.stdout, sys.stderr = self._streams
        for fd, saved in zip((1, 2), self._saved, strict=True):
            os.dup2(saved, fd)
            os.close(saved)
        # The pipe has no writer left here: the reader reads what is left and sees its end
        # (or stops soon if a subprocess the task left behind still holds it).
        self._ending.set()
        self._reader.join()
        os.close(self._read_end)
        lines = self._take()
        try:
            if lines:
                self.write(lines)
        except Exception as exc:
            log.warning(
                "could not store the last %d log line(s) of the attempt: %s", len(lines), exc
            )

    # -- threads ---------------------------------------------------------------------------------

    def _read(self) -> None:
        partial = b""
        while True:
            ready, _, _ = select.select([self._read_end], [], [], 0.1)
            if not ready:
                if self._ending.is_set():
                    break
                self._write_if_due()
                continue
            chunk = os.read(self._read_end, PIPE_BYTES)
            if not chunk:
                break
            if self._queued_bytes <= self.max_bytes:  # past the bound it is only drained
                *lines, partial = (partial + chunk).split(b"\n")
                pieces = [piece for line in lines for piece in _pieces(line) or [b""]]
                if len(partial) > MAX_LINE_BYTES:
                    *more, partial = _pieces(partial)
                    pieces += more
                self._queue(pieces)
            self._write_if_due()
            self._ending.wait(READ_PAUSE_SEC)
        if partial:
            self._queue([partial])

    def _queue(self, raw_lines: list[bytes]) -> None:
        at = dt.datetime.now(dt.UTC)
        with self._lock:
            for raw in raw_lines:
                if self._queued_bytes > self.max_bytes:
                    return  # past the bound: the store cuts the try here anyway
                self._queued_bytes += len(raw)
                text = raw.removesuffix(b"\r").decode("utf-8", "replace")
                self._queued.append(
                    NewLine(self.task_instance_id, self.try_number, at, SOURCE_TASK, text)
                )

    def _take(self) -> list[NewLine]:
        with self._lock:
            lines, self._queued = self._queued, []
        return lines

    def _write_if_due(self) -> None:
        """Write the queued lines if a batch is full or the last write is FLUSH_INTERVAL_SEC old
        (not once the attempt ends: the last batch is written on the way out)."""
        if self._ending.is_set():
            return
        now = time.monotonic()
        if len(self._queued) < BATCH_LINES and now - self._written_at < FLUSH_INTERVAL_SEC:
            return
        self._written_at = now
        lines = self._take()
        if not lines:
            return
        try:
            self.write(lines)
        except Exception:
            # The database is unavailable: keep the lines (in order) for the next batch.
            with self._lock:
                self._queued[:0] = lines


def _flush_std() -> None:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()


def _line_stream(fd: int) -> TextIO:
    return open(fd, "w", buffering=1, encoding="utf-8", errors="backslashreplace", closefd=False)


def _pieces(raw: bytes) -> list[bytes]:
    """A line cut into pieces of at most MAX_LINE_BYTES."""
    return [raw[start : start + MAX_LINE_BYTES] for start in range(0, len(raw), MAX_LINE_BYTES)]


def run_attempt(request: AttemptRequest, echo: Writer | None = None) -> Outcome:
    """What a worker child does with a request: the attempt, its output in the try's log (and,
    once stored, given to ``echo``: ``deferral dags test`` shows it as it comes)."""
    max_bytes = request.task_log_max_bytes

    def store(lines: Sequence[NewLine]) -> None:
        with metastore().sessions.begin() as session:
            tasklogs.append(session, lines, max_bytes)
        if echo is not None:
            echo(lines)

    with TaskOutput(request.task_instance_id, request.try_number, store, max_bytes):
        return execute_attempt(request)
