"""Reusable task processes, any one of which can be killed.

Each child runs one attempt at a time (``worker.attempt``) and answers on its own pipe; requests
and answers are bytes (``worker.outcomes`` encodes them), not pickles. The worker waits on all
pipes at once, and can SIGKILL the child of one attempt (its lease was lost, it must not go on)
without touching the others; a killed or crashed child is replaced by a fresh one on demand.

Children come from the pool's fork server: a process forked from the worker when the pool is
made, at the worker's start, before it has a thread, a connection or a signal handler, so it
holds the worker's imports (the task runtime) and nothing else of it; it forks each child, so a
child starts in milliseconds. (multiprocessing's ``forkserver`` execs a fresh interpreter that
imports it all again: a second and a half of CPU per worker start.) The server reports each
child's exit status on a pipe of its own, and asks Linux to kill it when the worker dies, as each
child does when the server dies (PR_SET_PDEATHSIG): an attempt never outlives its worker.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import select
import selectors
import signal
import socket
import struct
import sys
import traceback
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from multiprocessing.connection import Connection, Pipe
from typing import Generic, TypeVar

from deferral.runtime.process import die_with_parent
from deferral.store import metastore

log = logging.getLogger("deferral.worker")

K = TypeVar("K", bound=Hashable)


READY = b"ready"
_PID = struct.Struct("q")
_STATUS = struct.Struct("i")


class ForkServerGone(SystemExit):
    """The fork server died (someone killed it): the worker exits (status 1) so that its
    supervisor starts it again with a fresh one; its children died with the server, and their
    attempts are failed into their retries like those of a killed worker. (A SystemExit: the
    service loop, which retries errors, must not retry this one.)"""

    def __init__(self, pid: int) -> None:
        super().__init__(f"the worker's task process server (pid {pid}) died; exiting")


def _child_main(
    conn: Connection, run: Callable[[bytes], bytes], warm: Callable[[], None] | None
) -> None:
    if warm is not None:
        warm()
    conn.send_bytes(READY)
    while True:
        try:
            request = conn.recv_bytes()
        except (EOFError, OSError):
            return
        conn.send_bytes(run(request))


def _exit_status(main: Callable[[], None]) -> int:
    """Run a forked child's ``main``; its exit status as the interpreter would give it."""
    try:
        main()
        return 0
    except SystemExit as exc:
        code = exc.code
        return code if isinstance(code, int) else (0 if code is None else 1)
    except BaseException:
        traceback.print_exc()
        return 1
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()


class _ForkServer:
    """The worker's side of the fork server (see the module docstring)."""

    def __init__(self, child_main: Callable[[Connection], None]) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        pid = os.fork()
        if pid == 0:
            ours.close()
            # A worker embedded in a process that had used the metastore (dags test, the
            # tests' in-process worker): its children must not share those connections.
            metastore.forget_connections()
            os._exit(_exit_status(lambda: _serve(theirs, child_main)))
        theirs.close()
        self.pid = pid
        self._sock = ours

    def fork(self) -> tuple[TaskProcess, Connection]:
        """A new child, and the worker's end of its pipe."""
        parent_end, child_end = Pipe()
        status_r, status_w = os.pipe()
        try:
            socket.send_fds(self._sock, [b"f"], [child_end.fileno(), status_w])
            answer = b""
            while len(answer) < _PID.size:
                more = self._sock.recv(_PID.size - len(answer))
                if not more:
                    raise ConnectionError("the fork server closed its socket")
                answer += more
        except OSError:
            os.close(status_r)
            parent_end.close()
            raise ForkServerGone(self.pid) from None
        finally:
            child_end.close()
            os.close(status_w)
        (pid,) = _PID.unpack(answer)
        return TaskProcess(pid, status_r), parent_end

    def close(self) -> None:
        """Let the server go (it exits when its socket closes) and reap it."""
        self._sock.close()
        for _ in range(50):
            with contextlib.suppress(ChildProcessError):
                if os.waitpid(self.pid, os.WNOHANG)[0] == 0:
                    select.select([], [], [], 0.1)
                    continue
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(self.pid, 0)


def _serve(sock: socket.socket, child_main: Callable[[Connection], None]) -> None:
    """The fork server: fork a child for each request (the fd of its end of the pipe, and the
    write end of its status pipe), answer its pid, and write its exit status once it ends.
    Returns when the worker's end of ``sock`` closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the worker's to handle
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    die_with_parent()
    # Logging as in a fresh interpreter: the worker's handler on stderr would add its own
    # formatted copy of every line a task logs to the output the attempt captures.
    root = logging.getLogger()
    for handler in root.handlers[:]:
        root.removeHandler(handler)
    root.setLevel(logging.WARNING)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    statuses: dict[int, int] = {}  # child pid -> write end of its status pipe
    while True:
        ready, _, _ = select.select([sock.fileno(), wake_r], [], [])
        if wake_r in ready:
            os.read(wake_r, 4096)
            _report_exits(statuses)
        if sock.fileno() not in ready:
            continue
        message, fds, _, _ = socket.recv_fds(sock, 1, 2)
        if not message:
            return
        conn_fd, status_w = fds
        pid = os.fork()
        if pid == 0:
            signal.set_wakeup_fd(-1)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            for fd in (sock.fileno(), wake_r, wake_w, status_w, *statuses.values()):
                os.close(fd)
            die_with_parent()
            os._exit(_exit_status(functools.partial(child_main, Connection(conn_fd))))
        os.close(conn_fd)
        statuses[pid] = status_w
        sock.sendall(_PID.pack(pid))


def _report_exits(statuses: dict[int, int]) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        status_w = statuses.pop(pid, None)
        if status_w is not None:
            with contextlib.suppress(OSError):
                os.write(status_w, _STATUS.pack(os.waitstatus_to_exitcode(status)))
            os.close(status_w)


class TaskProcess:
    """A child forked by the fork server, as the worker sees it: its pid, and its exit status
    read from its status pipe (``sentinel``, readable once it ended)."""

    def __init__(self, pid: int, sentinel: int) -> None:
        self.pid = pid
        self.sentinel = sentinel
        self._exitcode: int | None = None

    def join(self, timeout: float | None = None) -> None:
        """Wait up to ``timeout`` seconds for it to end."""
        if self._exitcode is not None or self.sentinel < 0:
            return
        if select.select([self.sentinel], [], [], timeout)[0]:
            data = os.read(self.sentinel, _STATUS.size)
            # Nothing written: the server died, and the child with it (PR_SET_PDEATHSIG).
            self._exitcode = _STATUS.unpack(data)[0] if len(data) == _STATUS.size else -9

    @property
    def exitcode(self) -> int | None:
        self.join(0)
        return self._exitcode

    def is_alive(self) -> bool:
        return self.exitcode is None

    def kill(self) -> None:
        """SIGKILL it, unless it has ended (its pid may be another process's by now)."""
        if self.is_alive():
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)

    def close(self) -> None:
        if self.sentinel >= 0:
            os.close(self.sentinel)
            self.sentinel = -1


@dataclass
class _Child:
    process: TaskProcess
    conn: Connection
    ready: bool = False
    attempts: int = 0  # requests answered


@dataclass(frozen=True)
class ChildDied:
    """What a busy child left instead of an outcome: it exited or was killed."""

    exitcode: int | None

    def describe(self) -> str:
        code = self.exitcode
        if code is not None and code < 0:
            return f"task process killed by {signal.Signals(-code).name}"
        return f"task process exited with code {code}"


class ChildPool(Generic[K]):
    """``run(request)`` is what a child does with each request; ``warm()``, what it does once
    before it says it is ready (import what tasks need). A child that answered
    ``max_attempts`` requests is replaced by a fresh one (leaky task code)."""

    def __init__(
        self,
        run: Callable[[bytes], bytes],
        warm: Callable[[], None] | None = None,
        max_attempts: int | None = None,
    ) -> None:
        self._run = run
        self._warm = warm
        self._max_attempts = max_attempts
        self._server = _ForkServer(lambda conn: _child_main(conn, run, warm))
        self._idle: list[_Child] = []
        self._busy: dict[K, _Child] = {}
        # The pipes and exit sentinels of the busy children, registered while they are busy:
        # building the set to wait on at every collect() was a share of the worker's loop.
        self._busy_fds = selectors.DefaultSelector()

    @property
    def busy(self) -> int:
        return len(self._busy)

    def pid_of(self, key: K) -> int | None:
        child = self._busy.get(key)
        return None if child is None else child.process.pid

    def prestart(self, count: int, timeout: float = 120.0) -> None:
        """Start ``count`` idle children and wait until they are ready: a child takes a while to
        load the DAGs folder, and an attempt's execution_timeout runs from its start."""
        for _ in range(count - len(self._idle) - len(self._busy)):
            self._idle.append(self._spawn(wait=False))
        for child in self._idle:
            self._await_ready(child, timeout)

    def _spawn(self, wait: bool = True) -> _Child:
        process, conn = self._server.fork()
        child = _Child(process, conn)
        if wait:
            self._await_ready(child, timeout=120.0)
        return child

    @staticmethod
    def _await_ready(child: _Child, timeout: float) -> None:
        if child.ready:
            return
        try:
            child.ready = child.conn.poll(timeout) and child.conn.recv_bytes() == READY
        except (EOFError, OSError):
            child.ready = False  # it died starting: submit() replaces it

    def submit(self, key: K, request: bytes) -> None:
        """Run ``request`` in an idle child (a new one if none is idle)."""
        while self._idle:
            child = self._idle.pop()
            if child.process.is_alive():
                self._await_ready(child, timeout=120.0)  # a replacement may still be warming
                break
            self._discard(child)
        else:
            child = self._spawn()
        try:
            child.conn.send_bytes(request)
        except OSError:
            self._discard(child)
            child = self._spawn()
            child.conn.send_bytes(request)
        self._busy[key] = child
        self._busy_fds.register(child.conn.fileno(), selectors.EVENT_READ, key)
        self._busy_fds.register(child.process.sentinel, selectors.EVENT_READ, key)

    def _take_busy(self, key: K) -> _Child | None:
        child = self._busy.pop(key, None)
        if child is not None:
            self._busy_fds.unregister(child.conn.fileno())
            self._busy_fds.unregister(child.process.sentinel)
        return child

    def collect(self, timeout: float) -> list[tuple[K, bytes | ChildDied]]:
        """Outcomes of the attempts that ended within ``timeout`` seconds: what the child sent,
        or :class:`ChildDied`."""
        if not self._busy:
            return []
        keys = {selected.data for selected, _ in self._busy_fds.select(timeout)}
        ended: list[tuple[K, bytes | ChildDied]] = []
        for key in keys:
            child = self._take_busy(key)
            assert child is not None
            try:
                if not child.conn.poll():
                    raise EOFError
                ended.append((key, child.conn.recv_bytes()))
            except (EOFError, OSError):
                child.process.join(timeout=5)
                ended.append((key, ChildDied(child.process.exitcode)))
                self._discard(child)
                continue
            child.attempts += 1
            if self._max_attempts is not None and child.attempts >= self._max_attempts:
                self._recycle(child)
            else:
                self._idle.append(child)
        return ended

    def _recycle(self, child: _Child) -> None:
        """Replace a child that ran its share of attempts: it exits once its pipe closes (the
        server reaps it); the fresh one warms up meanwhile."""
        child.conn.close()
        child.process.close()
        self._idle.append(self._spawn(wait=False))

    def kill(self, key: K) -> bool:
        """SIGKILL the child running ``key`` (at once: its attempt must not go on)."""
        child = self._take_busy(key)
        if child is None:
            return False
        child.process.kill()
        child.process.join(timeout=5)
        self._discard(child)
        return True

    def _discard(self, child: _Child) -> None:
        child.conn.close()
        if child.process.is_alive():
            child.process.kill()
            child.process.join(timeout=5)
        child.process.close()

    def shutdown(self) -> None:
        for key in list(self._busy):
            self.kill(key)
        for child in self._idle:
            child.conn.close()  # the child's recv() ends: it exits
        for child in self._idle:
            child.process.join(timeout=5)
            child.process.kill()
            child.process.close()
        self._idle.clear()
        self._busy_fds.close()
        self._server.close()
