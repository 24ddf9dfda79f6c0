"""Which errors are transient, and a test-only switch that injects them.

A transient error (the database or Redis unreachable, a deadlock, a serialization failure) says
nothing about the work at hand: the work is retried with backoff, never dead-lettered or failed.
Every other error is a data error: it belongs to one entry or one run, which is set aside with the
reason while the rest carries on. The decision is made from exception types and SQLSTATE codes,
never from message text.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from types import ModuleType

import psycopg
from sqlalchemy.exc import DBAPIError, OperationalError

# SQLSTATE classes: 08 connection exception, 40 transaction rollback (serialization failure,
# deadlock), 53 insufficient resources, 57 operator intervention (shutdown, cancel), 58 system
# error.
_TRANSIENT_SQLSTATE_CLASSES = frozenset({"08", "40", "53", "57", "58"})
READ_ONLY_SQL_TRANSACTION = "25006"
# lock_not_available; read_only_sql_transaction: the connection reached a standby (a failover or
# switchover under way; the engine drops the connection, deferral.store.db.make_engine).
_TRANSIENT_SQLSTATES = frozenset({"55P03", READ_ONLY_SQL_TRANSACTION})

# Redis failing as a server: unreachable, loading, a read-only replica, or full (``maxmemory``
# reached with ``noeviction``: writes refused until memory is freed, reads still answered).
_REDIS_DOWN = (
    "ConnectionError",
    "TimeoutError",
    "BusyLoadingError",
    "ReadOnlyError",
    "TryAgainError",
    "OutOfMemoryError",
)


def loaded_redis_errors() -> ModuleType | None:
    """redis-py's exceptions module if the process imported redis-py, else None: an exception of
    its classes exists only then, so a process that never talks to Redis (a CLI listing) does
    not import the client (a fifth of `deferral dags list`'s imports) just to rule them out."""
    return sys.modules.get("redis.exceptions")


def _transient_sqlstate(code: str | None) -> bool:
    return code is not None and (
        code[:2] in _TRANSIENT_SQLSTATE_CLASSES or code in _TRANSIENT_SQLSTATES
    )


def redis_down(exc: BaseException) -> bool:
    """Whether ``exc`` says Redis fails as a server (unreachable, loading, read-only, full)."""
    errors = loaded_redis_errors()
    return errors is not None and isinstance(
        exc, tuple(getattr(errors, name) for name in _REDIS_DOWN)
    )


def is_transient(exc: BaseException) -> bool:
    """Whether ``exc`` says the servers are unavailable or busy, not that the work is bad."""
    errors = loaded_redis_errors()
    if errors is not None:
        if redis_down(exc):
            return True
        if isinstance(exc, errors.ResponseError):
            # The stream or group was lost (Redis restarted without its data, or the key
            # deleted while a consumer blocked on it): recreate and retry.
            return str(exc).startswith(("NOGROUP", "UNBLOCKED"))
    if isinstance(exc, DBAPIError):
        if exc.connection_invalidated:
            return True
        if isinstance(exc.orig, psycopg.Error):
            return _transient_psycopg(exc.orig)
        return isinstance(exc, OperationalError)
    # Raw, as a connect raises it before SQLAlchemy wraps it.
    return isinstance(exc, psycopg.Error) and _transient_psycopg(exc)


def _transient_psycopg(error: psycopg.Error) -> bool:
    if error.sqlstate is None:
        # No server answer at all: the connection failed.
        return isinstance(error, psycopg.OperationalError)
    return _transient_sqlstate(error.sqlstate)


# -- fault injection (tests only) ------------------------------------------------------------------

FAULTS_ENV = "DEFERRAL_TEST_FAULTS"
CRASH = -1  # the process kills itself (SIGKILL) at the point

_lock = threading.Lock()
_remaining: dict[str, int] | None = None


def _parse(raw: str) -> dict[str, int]:
    """``point:count,point:crash``."""
    faults: dict[str, int] = {}
    for item in filter(None, (part.strip() for part in raw.split(","))):
        point, _, count = item.partition(":")
        faults[point] = CRASH if count == "crash" else int(count or "1")
    return faults


def inject(point: str) -> None:
    """At ``point``, do what ``DEFERRAL_TEST_FAULTS`` asks (nothing when it is unset): raise a
    transient database error (a serialization failure) while it asks for more (``point:3``), or
    die at once as kill -9 would (``point:crash``)."""
    global _remaining
    with _lock:
        if _remaining is None:
            _remaining = _parse(os.environ.get(FAULTS_ENV, ""))
        left = _remaining.get(point, 0)
        if left == CRASH:
            os.kill(os.getpid(), signal.SIGKILL)
        if left <= 0:
            return
        _remaining[point] = left - 1
    raise OperationalError(
        f"injected fault at {point}",
        None,
        psycopg.errors.SerializationFailure(f"injected at {point} ({FAULTS_ENV})"),
    )
