"""Reusable task processes, any one of which can be killed.

Each child runs one attempt at a time (``worker.attempt``) and answers on its own pipe; requests
and answers are bytes (``worker.outcomes`` encodes them), not pickles. The worker waits on all
pipes at once, and can SIGKILL the child of one attempt (its lease was lost, it must not go on)
without touching the others; a killed or crashed child is replaced by a fresh one on demand.

Children are forked from the worker's fork server (multiprocessing's ``forkserver``): a process
spawned fresh, not forked from the worker, so nothing of the worker leaks in, which has imported
what tasks need once, so a child starts in milliseconds instead of a second of imports. Each child
closes its copy of the server's "alive" pipe, so the server exits when the worker does, and asks
Linux to kill it when the server dies (PR_SET_PDEATHSIG): an attempt never outlives its worker.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import multiprocessing.forkserver
import os
import selectors
import signal
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Generic, TypeVar

from deferral.process import die_with_parent

log = logging.getLogger("deferral.worker")

K = TypeVar("K", bound=Hashable)


READY = b"ready"

# What the fork server imports once for every child: the entry point, the pool, and the attempt
# code with the whole authoring API and ORM it needs.
PRELOAD = ["worker.cli", "worker.children", "worker.attempt", "worker.capture"]


def _let_the_fork_server_go() -> None:
    """Close this child's copy of the write end of the fork server's "alive" pipe. Every client
    of the server holds one, and the server runs until all are closed: with the children holding
    theirs, a killed worker left the server, and so the children (whose parent it is), running.
    (multiprocessing keeps the fd in a private attribute; without it there is nothing to close.)"""
    server = multiprocessing.forkserver._forkserver
    fd = getattr(server, "_forkserver_alive_fd", None)
    if fd is not None:
        os.close(fd)
        server._forkserver_alive_fd = None  # type: ignore[attr-defined]


def _child_main(
    conn: Connection, run: Callable[[bytes], bytes], warm: Callable[[], None] | None
) -> None:
    # Ctrl-C is the worker's: it lets running attempts finish before it exits.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _let_the_fork_server_go()
    die_with_parent()
    if warm is not None:
        warm()
    conn.send_bytes(READY)
    while True:
        try:
            request = conn.recv_bytes()
        except (EOFError, OSError):
            return
        conn.send_bytes(run(request))


@dataclass
class _Child:
    process: BaseProcess
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
        self._context = multiprocessing.get_context("forkserver")
        self._context.set_forkserver_preload(PRELOAD)
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
        parent_end, child_end = self._context.Pipe()
        process = self._context.Process(
            target=_child_main, args=(child_end, self._run, self._warm), daemon=True
        )
        process.start()
        child_end.close()
        child = _Child(process, parent_end)
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
        """Replace a child that ran its share of attempts: it exits once its pipe closes (and
        is reaped when a later child starts); the fresh one warms up meanwhile."""
        child.conn.close()
        self._idle.append(self._spawn(wait=False))

    def kill(self, key: K) -> bool:
        """SIGKILL the child running ``key`` (at once: its attempt must not go on)."""
        child = self._take_busy(key)
        if child is None:
            return False
        if child.process.pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(child.process.pid, signal.SIGKILL)
        child.process.join(timeout=5)
        self._discard(child)
        return True

    def _discard(self, child: _Child) -> None:
        child.conn.close()
        if child.process.is_alive():
            child.process.kill()
            child.process.join(timeout=5)

    def shutdown(self) -> None:
        for key in list(self._busy):
            self.kill(key)
        for child in self._idle:
            child.conn.close()  # the child's recv() ends: it exits
        for child in self._idle:
            child.process.join(timeout=5)
            if child.process.is_alive():
                child.process.kill()
        self._idle.clear()
        self._busy_fds.close()
