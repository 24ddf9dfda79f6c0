"""A worker's task processes never share a metastore connection with the process that made the
pool (a worker embedded in `dags test`, or in the tests' own process, may have used it first):
two processes on one connection mix their statements."""

from __future__ import annotations

import pytest
from cryptography.fernet import Fernet
from sqlalchemy import text

from deferral.store.metastore import metastore
from worker.children import ChildDied, ChildPool

_BACKEND_PID = text("SELECT pg_backend_pid()")


def _backend_pid(_request: bytes) -> bytes:
    with metastore().sessions() as session:
        return str(session.scalar(_BACKEND_PID)).encode()


def test_a_task_process_opens_its_own_connection_not_its_parents(
    database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DEFERRAL_DATABASE_URL", database_url)
    monkeypatch.setenv("DEFERRAL_FERNET_KEY", Fernet.generate_key().decode())
    with metastore().sessions() as session:  # pooled here, idle, when the pool forks
        ours = session.scalar(_BACKEND_PID)
    pool: ChildPool[int] = ChildPool(_backend_pid)
    try:
        pool.submit(1, b"which")
        ended: list[tuple[int, bytes | ChildDied]] = []
        while not ended:
            ended = pool.collect(timeout=60)
    finally:
        pool.shutdown()
    ((_, theirs),) = ended
    assert isinstance(theirs, bytes), theirs
    assert int(theirs) != ours
    with metastore().sessions() as session:  # and ours still works
        assert session.scalar(_BACKEND_PID) == ours
