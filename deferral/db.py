"""Engine and session factory, and waiting for the database at start."""

from __future__ import annotations

import logging
import math
import threading

from sqlalchemy import Engine, create_engine, text
from sqlalchemy.engine import URL
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session, sessionmaker

from deferral.faults import is_transient

log = logging.getLogger("deferral")


def make_engine(
    database_url: str, *, pool_size: int = 5, timeout_sec: float | None = None
) -> Engine:
    """``timeout_sec``: the most a connection attempt or a statement may take (a connection
    that hangs rather than fails would otherwise hold its caller for ever: the triggerer's lease
    thread must come back within a heartbeat)."""
    # No pre-ping: it costs a round trip per transaction. A connection that went stale (the
    # server restarted) fails its statement with a transient error, is invalidated, and the
    # work is retried on a fresh one.
    if timeout_sec is None:
        return create_engine(database_url, pool_size=pool_size)
    connect_args = {
        "connect_timeout": max(1, math.ceil(timeout_sec)),
        "options": f"-c statement_timeout={max(1, round(timeout_sec * 1000))}",
    }
    return create_engine(
        database_url, pool_size=pool_size, pool_timeout=timeout_sec, connect_args=connect_args
    )


def make_sessionmaker(engine: Engine) -> sessionmaker[Session]:
    return sessionmaker(engine, expire_on_commit=False)


def location(engine: Engine) -> str:
    """host:port/database of an engine, without credentials, for messages."""
    return url_location(engine.url)


def url_location(url: URL) -> str:
    """host:port/database of a database URL, without credentials (a Unix socket's directory for
    its host), for messages."""
    socket_dir = url.query.get("host")
    host = url.host or (socket_dir if isinstance(socket_dir, str) else None) or "localhost"
    return f"{host}:{url.port or 5432}/{url.database}"


def wait_until_up(engine: Engine, stop: threading.Event) -> bool:
    """Wait (saying so once) until the database answers; False if ``stop`` is set first."""
    delay, said = 0.5, False
    while not stop.is_set():
        try:
            with engine.connect() as conn:
                conn.execute(text("SELECT 1"))
        except SQLAlchemyError as exc:
            if not is_transient(exc):
                raise
            if not said:
                first = str(exc.orig if hasattr(exc, "orig") else exc).strip().splitlines()
                log.warning(
                    "PostgreSQL at %s is unreachable (%s); waiting for it",
                    location(engine),
                    first[0] if first else type(exc).__name__,
                )
                said = True
            stop.wait(delay)
            delay = min(delay * 2, 5.0)
            continue
        if said:
            log.info("PostgreSQL at %s is up", location(engine))
        return True
    return False
