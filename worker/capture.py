"""What task attempts write, captured in their task process into each try's task log.

Once a task process takes its first attempt, its file descriptors 1 and 2 point at one pipe for
good (as ``2>&1`` does), so ``print``, ``logging`` (a handler on the root logger, writing to
stderr) and the output of subprocesses and C code arrive in the order they were written. One
thread, started once per process and living across attempts, reads the pipe and writes what
it read in batches of the running try (every half second, or sooner when it grows), while the
enlarged pipe holds what the task writes meanwhile, so the task never waits for the database.
Setting this up per attempt (a pipe, dup2s, new streams, a handler and a thread started and
joined) was 60 % of a task process's CPU at hundreds of attempts a second.

When an attempt ends with something of its output still in the pipe or in the reader's hands,
the process writes an end marker into the pipe behind it and the reader hands over the try's
last lines when it reads the marker (else the try ends at once, without waking the reader); they
are written before the outcome goes to the worker, which commits it only then: a finished try's
log is complete. What arrives between attempts (from something an earlier attempt left running) goes
to the task process's own stderr, never into another try's log.
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
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from functools import cache
from typing import NamedTuple, TextIO

from deferral.store import tasklogs
from deferral.store.metastore import metastore
from deferral.store.tasklogs import LOG_FORMAT, SOURCE_TASK, NewLine
from worker import outcomes
from worker.attempt import execute_attempt

log = logging.getLogger("deferral.worker.capture")

FLUSH_INTERVAL_SEC = 0.5
# The reader takes what the pipe holds this often, not at every write: waking per line would
# contend with the task for the GIL (task_output.py measures it). The pipe is enlarged so that
# the task does not wait in between.
READ_PAUSE_SEC = 0.02
PIPE_BYTES = 1024 * 1024
BATCH_LINES = 1000
# A longer run of bytes without a newline is stored as several lines.
MAX_LINE_BYTES = 64 * 1024

# Lines of one try, and that try's DEFERRAL_TASK_LOG_MAX_BYTES.
Writer = Callable[[Sequence[NewLine], int], None]


class _Try(NamedTuple):
    task_instance_id: int
    try_number: int
    max_bytes: int


class TaskOutput:
    """Captures fds 1 and 2 of this process, from :meth:`install` to :meth:`uninstall`, into
    ``write``: during :meth:`attempt`, as batches of lines of that try. At most about the try's
    ``max_bytes`` wait in memory: its log is cut there anyway, and one line past it is kept so
    that the store writes the cut marker. Attempts run one at a time."""

    def __init__(self, write: Writer) -> None:
        self.write = write
        # Written in one write() (under PIPE_BUF, so never interleaved with other writes) and
        # unlike anything a task prints: a NUL, and a number of this process's.
        nonce = os.urandom(8).hex().encode()
        self._start_marker = b"\0deferral-attempt-start-" + nonce + b"\0"
        self._end_marker = b"\0deferral-attempt-end-" + nonce + b"\0"
        self._try: _Try | None = None
        self._next: _Try | None = None  # the try a start marker in the pipe begins
        self._partial = b""  # read, not yet a line
        # Held by the reader while it reads, assigns and writes; taken by the attempt's start
        # and end when the reader has nothing in hand, to switch tries without waking it.
        self._turn = threading.Lock()
        self._queued: list[NewLine] = []
        self._queued_bytes = 0  # of the running try, written or not
        self._lock = threading.Lock()
        self._end_asked = threading.Event()
        self._ended = threading.Event()
        self._written_at = 0.0
        self._installed = False

    def __enter__(self) -> TaskOutput:
        self.install()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.uninstall()

    def install(self) -> None:
        _flush_std()
        read_end, write_end = os.pipe()
        with contextlib.suppress(OSError, AttributeError):  # Linux only; a smaller limit
            fcntl.fcntl(write_end, fcntl.F_SETPIPE_SZ, PIPE_BYTES)
        self._read_end, self._write_end = read_end, write_end
        self._saved = (os.dup(1), os.dup(2))
        os.dup2(write_end, 1)
        os.dup2(write_end, 2)
        # Line-buffered streams on the pipe (Python's own would be block-buffered there, and
        # print() would come after later log lines); whatever stood in for them comes back after.
        self._saved_streams = (sys.stdout, sys.stderr)
        self._streams = (_line_stream(1), _line_stream(2))
        sys.stdout, sys.stderr = self._streams
        self._handler = logging.StreamHandler(self._streams[1])
        self._handler.setFormatter(logging.Formatter(LOG_FORMAT))
        root = logging.getLogger()
        self._root_level = root.level
        root.addHandler(self._handler)
        self._installed = True
        self._reader = threading.Thread(target=self._read, name="task-output", daemon=True)
        self._reader.start()

    def uninstall(self) -> None:
        """Restore fds 1 and 2, the streams and the logging of before :meth:`install`, and stop
        the reader (what a subprocess left running still writes is dropped)."""
        if not self._installed:
            return
        _flush_std()
        root = logging.getLogger()
        root.removeHandler(self._handler)
        if root.level != self._root_level:
            root.setLevel(self._root_level)
        sys.stdout, sys.stderr = self._saved_streams
        for fd, saved in zip((1, 2), self._saved, strict=True):
            os.dup2(saved, fd)
        self._installed = False
        os.write(self._write_end, b"\n")  # wakes the reader, which sees it is uninstalled
        os.close(self._write_end)
        self._reader.join()
        for fd in (*self._saved, self._read_end):
            os.close(fd)

    @contextmanager
    def attempt(self, task_instance_id: int, try_number: int, max_bytes: int) -> Iterator[None]:
        """Capture into this try's log while the attempt runs; on the way out, wait until the
        reader has everything the attempt wrote and write the last batch."""
        self._begin(_Try(task_instance_id, try_number, max_bytes))
        try:
            yield
        finally:
            self._end(max_bytes)

    def _begin(self, current: _Try) -> None:
        # Undo what the previous attempt may have changed: where fds 1 and 2 point, the
        # streams, the handler, the level (all cheap when nothing changed).
        os.dup2(self._write_end, 1)
        os.dup2(self._write_end, 2)
        if any(stream.closed for stream in self._streams):
            self._streams = (_line_stream(1), _line_stream(2))
            self._handler.stream = self._streams[1]  # setStream would flush the closed one
        sys.stdout, sys.stderr = self._streams
        root = logging.getLogger()
        if self._handler not in root.handlers:
            root.addHandler(self._handler)
        # Only when it differs: every setLevel clears the cache of every logger of the process
        # (a few percent of a worker's CPU at hundreds of attempts a second).
        if root.level != logging.INFO:
            root.setLevel(logging.INFO)
        self._written_at = time.monotonic()
        if self._claim_if_quiet():
            # Nothing of before this attempt is left to read: what comes is the try's.
            self._close_try()
            with self._lock:
                self._try, self._queued, self._queued_bytes = current, [], 0
            self._turn.release()
            return
        # What is still in the pipe is not this try's: the reader switches at the marker.
        self._next = current
        os.write(self._write_end, self._start_marker)

    def _end(self, max_bytes: int) -> None:
        _flush_std()
        if self._claim_if_quiet():
            # The reader has taken in everything the attempt wrote (the common case of an
            # attempt that wrote nothing, or nothing lately): no marker, no waking it.
            self._close_try()
            self._turn.release()
        else:
            self._ended.clear()
            self._end_asked.set()  # the reader may be pausing: read now (it clears this)
            os.write(self._write_end, self._end_marker)
            while not self._ended.wait(1.0) and self._reader.is_alive():
                pass  # a reader that died (it should not) must not hang every attempt after
        lines = self._take()
        try:
            if lines:
                self.write(lines, max_bytes)
        except Exception as exc:
            log.warning(
                "could not store the last %d log line(s) of the attempt: %s", len(lines), exc
            )

    def _claim_if_quiet(self) -> bool:
        """Take the reader's turn if it holds nothing and nothing waits in the pipe: all that
        was written so far has been assigned to a try (but an unfinished line)."""
        if not self._turn.acquire(blocking=False):
            return False
        if select.select([self._read_end], [], [], 0)[0]:
            self._turn.release()
            return False
        return True

    def _close_try(self) -> None:
        """The unfinished line is the running try's last (or, between attempts, no try's);
        nothing after is the try's. The caller holds the turn."""
        partial, self._partial = self._partial, b""
        if partial:
            self._lines([partial])
        with self._lock:
            self._try = None

    # -- the reader thread -----------------------------------------------------------------------

    def _read(self) -> None:
        while self._installed:
            ready, _, _ = select.select([self._read_end], [], [], self._wait_sec())
            with self._turn:
                if ready:
                    chunk = os.read(self._read_end, PIPE_BYTES)
                    if not chunk:
                        return
                    self._partial = self._take_in(self._partial + chunk)
                self._write_if_due()
            if ready and self._try is not None:
                self._end_asked.wait(READ_PAUSE_SEC)

    def _wait_sec(self) -> float | None:
        """How long select may block: until a batch is due, and for ever while nothing waits
        (an idle task process does not wake)."""
        if not self._queued:
            return None
        return max(0.0, self._written_at + FLUSH_INTERVAL_SEC - time.monotonic())

    def _take_in(self, data: bytes) -> bytes:
        """Queue the complete lines of ``data`` for the try they belong to, switching tries at
        the markers; returns the rest, an incomplete line."""
        while True:
            starts, ends = data.find(self._start_marker), data.find(self._end_marker)
            at = min(i for i in (starts, ends, len(data)) if i >= 0)
            if at == len(data):
                break
            self._partial = self._take_in(data[:at])
            self._close_try()
            marker = self._start_marker if at == starts else self._end_marker
            data = data[at + len(marker) :]
            if marker is self._start_marker:
                with self._lock:
                    self._try, self._queued, self._queued_bytes = self._next, [], 0
                continue
            self._end_asked.clear()
            self._ended.set()
        *lines, partial = data.split(b"\n")
        if len(partial) > MAX_LINE_BYTES:
            *more, partial = _pieces(partial)
            lines += more
        if lines:
            self._lines(lines)
        return partial

    def _lines(self, raw_lines: list[bytes]) -> None:
        current = self._try
        if current is None:  # between attempts: not any try's
            with contextlib.suppress(OSError):
                os.write(self._saved[1], b"".join(line + b"\n" for line in raw_lines))
            return
        at = dt.datetime.now(dt.UTC)
        with self._lock:
            for raw in raw_lines:
                for piece in _pieces(raw) or [b""]:
                    if self._queued_bytes > current.max_bytes:
                        return  # past the bound: the store cuts the try here anyway
                    self._queued_bytes += len(piece)
                    text = piece.removesuffix(b"\r").decode("utf-8", "replace")
                    self._queued.append(
                        NewLine(current.task_instance_id, current.try_number, at, SOURCE_TASK, text)
                    )

    def _take(self) -> list[NewLine]:
        with self._lock:
            lines, self._queued = self._queued, []
        return lines

    def _write_if_due(self) -> None:
        """Write the queued lines of the running try if a batch is full or the last write is
        FLUSH_INTERVAL_SEC old (not once it ended: its last batch is written on the way out)."""
        current = self._try
        if current is None or not self._queued:
            return
        now = time.monotonic()
        if len(self._queued) < BATCH_LINES and now - self._written_at < FLUSH_INTERVAL_SEC:
            return
        self._written_at = now
        lines = self._take()
        try:
            self.write(lines, current.max_bytes)
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


def _store(lines: Sequence[NewLine], max_bytes: int) -> None:
    with metastore().sessions.begin() as session:
        tasklogs.append(session, lines, max_bytes)


@cache
def _task_output() -> TaskOutput:
    """This task process's capture, installed at its first attempt (what the process wrote
    while starting stays on its own stderr)."""
    output = TaskOutput(_store)
    output.install()
    return output


def run_attempt(data: bytes) -> bytes:
    """What a worker child does with an encoded request: the attempt, its output in the try's
    log; returns the encoded outcome."""
    request = outcomes.decode_request(data)
    with _task_output().attempt(
        request.task_instance_id, request.try_number, request.task_log_max_bytes
    ):
        return outcomes.encode(execute_attempt(request))


def attempt_runner(
    echo: Callable[[outcomes.AttemptRequest, Sequence[NewLine]], None],
) -> Callable[[bytes], bytes]:
    """What a task process of ``deferral dags test`` does with an encoded request: as
    :func:`run_attempt` (the output captured into the try's log), each stored batch also given
    to ``echo`` with the attempt's request (the command shows them as they come)."""
    running: list[outcomes.AttemptRequest] = []
    output: list[TaskOutput] = []  # this process's capture, installed at its first attempt

    def store_and_echo(lines: Sequence[NewLine], max_bytes: int) -> None:
        _store(lines, max_bytes)
        if running:
            echo(running[-1], lines)

    def run(data: bytes) -> bytes:
        request = outcomes.decode_request(data)
        if not output:
            output.append(TaskOutput(store_and_echo))
            output[0].install()
        running[:] = [request]
        with output[0].attempt(
            request.task_instance_id, request.try_number, request.task_log_max_bytes
        ):
            return outcomes.encode(execute_attempt(request))

    return run
