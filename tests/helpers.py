"""Polling with deadlines: tests wait for a condition, never for a fixed time (and what they
poll for)."""

from __future__ import annotations

import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from sqlalchemy import text
from sqlalchemy.orm import Session, sessionmaker

from deferral.runtime import redis_urls

T = TypeVar("T")


def wait_for(
    condition: Callable[[], T], *, timeout: float = 120.0, interval: float = 0.05, what: str = ""
) -> T:
    """Return the first truthy value of ``condition()``; fail after ``timeout`` seconds (by
    default a bound for a machine loaded well beyond its cores: only a failure waits it out)."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what or condition}")
        time.sleep(interval)


def process_alive(pid: int) -> bool:
    """Whether a process runs (Linux; a zombie waiting to be reaped does not count)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def metrics_answer(host: str, port: int) -> bool:
    """Whether a metrics server answers at ``host``:``port``."""
    try:
        with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=10) as reply:
            return bool(reply.status == 200)
    except OSError:
        return False


def redis_cli_target(url: str) -> list[str]:
    """redis-cli's arguments for the Redis ``url`` names: ``-u url``, or for a Redis Cluster
    ``-c -h host -p port`` of its first node (``-c`` follows the cluster's redirections)."""
    where = redis_urls.parse(url)
    if where.kind != "cluster":
        return ["-u", url]
    host, port = where.hosts[0]
    return ["-c", "-h", host, "-p", str(port)]


def lock_waiters(sessions: sessionmaker[Session]) -> int:
    """How many sessions of the test database wait for a lock now."""
    with sessions() as session:
        return int(
            session.scalar(
                text(
                    "SELECT count(*) FROM pg_stat_activity"
                    " WHERE datname = current_database() AND wait_event_type = 'Lock'"
                )
            )
        )
