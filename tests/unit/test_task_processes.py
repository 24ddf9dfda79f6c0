"""worker.children.ChildPool with real forked processes: one request at a time per child, a
child replaced after its share of attempts or when it dies."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from worker.children import ChildDied, ChildPool, ForkServerGone


def _pid(request: bytes) -> bytes:
    if request == b"die":
        os._exit(3)
    return str(os.getpid()).encode()


def _run_one(pool: ChildPool[int], key: int, request: bytes = b"run") -> bytes | ChildDied:
    pool.submit(key, request)
    ended: list[tuple[int, bytes | ChildDied]] = []
    while not ended:
        ended = pool.collect(timeout=60)
    assert [k for k, _ in ended] == [key]
    return ended[0][1]


def test_a_task_process_is_replaced_after_max_attempts() -> None:
    pool: ChildPool[int] = ChildPool(_pid, max_attempts=2)
    try:
        pool.prestart(1)
        pids = [_run_one(pool, n) for n in range(5)]
    finally:
        pool.shutdown()
    assert pids[0] == pids[1] != pids[2] == pids[3] != pids[4]


def test_without_a_limit_one_task_process_runs_every_attempt() -> None:
    pool: ChildPool[int] = ChildPool(_pid)
    try:
        pool.prestart(1)
        pids = {_run_one(pool, n) for n in range(5)}
    finally:
        pool.shutdown()
    assert len(pids) == 1


def test_a_task_process_that_dies_is_reported_and_replaced() -> None:
    pool: ChildPool[int] = ChildPool(_pid)
    try:
        pool.prestart(1)
        first = _run_one(pool, 1)
        died = _run_one(pool, 2, b"die")
        after = _run_one(pool, 3)
    finally:
        pool.shutdown()
    assert died == ChildDied(3)
    assert after != first


def _sleep_then_pid(request: bytes) -> bytes:
    if request == b"hang":
        time.sleep(600)  # until killed
    return str(os.getpid()).encode()


def test_killing_one_busy_task_process_leaves_the_others_running() -> None:
    pool: ChildPool[int] = ChildPool(_sleep_then_pid)
    try:
        pool.prestart(2)
        pool.submit(1, b"hang")
        hung = pool.pid_of(1)
        assert pool.kill(1) and pool.busy == 0
        assert pool.collect(timeout=0.2) == []  # a killed attempt reports nothing
        assert _run_one(pool, 2) != str(hung).encode()
    finally:
        pool.shutdown()


def test_task_processes_come_from_one_fork_server_that_exits_with_the_pool() -> None:
    pool: ChildPool[int] = ChildPool(_pid)
    pool.prestart(2)
    server = pool._server.pid
    children = [int(_run_one(pool, n)) for n in range(2)]
    try:
        for child in children:  # forked by the server, not by this process
            assert (
                int(Path(f"/proc/{child}/stat").read_text().rsplit(")", 1)[1].split()[1]) == server
            )
    finally:
        pool.shutdown()
    with pytest.raises(ChildProcessError):  # exited and reaped
        os.waitpid(server, os.WNOHANG)


def test_a_killed_fork_server_takes_its_task_processes_and_stops_the_worker() -> None:
    pool: ChildPool[int] = ChildPool(_sleep_then_pid)
    try:
        pool.prestart(1)
        pool.submit(1, b"hang")
        os.kill(pool._server.pid, signal.SIGKILL)
        ended: list[tuple[int, bytes | ChildDied]] = []
        while not ended:
            ended = pool.collect(timeout=60)
        assert ended == [(1, ChildDied(-signal.SIGKILL))]  # the child died with its server
        with pytest.raises(ForkServerGone, match=r"task process server \(pid \d+\) died"):
            pool.submit(2, b"run")
    finally:
        pool.shutdown()
