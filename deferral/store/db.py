"""Engine and session factory, and waiting for the database at start."""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from functools import lru_cache
from typing import Any

import psycopg
from psycopg import pq
from psycopg.rows import namedtuple_row
from sqlalchemy import Connection, Engine, TextClause, create_engine, event, text
from sqlalchemy.dialects.postgresql import psycopg as postgresql_psycopg
from sqlalchemy.engine import URL, ExceptionContext
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session, sessionmaker

from deferral.runtime.config import TRANSACTION_POOLING, database_pooling
from deferral.runtime.faults import READ_ONLY_SQL_TRANSACTION, is_transient
from deferral.runtime.outages import first_line

log = logging.getLogger("deferral")


def make_engine(
    database_url: str,
    *,
    pool_size: int = 5,
    timeout_sec: float | None = None,
    pooling: str | None = None,
    **options: Any,
) -> Engine:
    """``timeout_sec``: the most a connection attempt or a statement may take (a connection
    that hangs rather than fails would otherwise hold its caller for ever: the triggerer's lease
    thread must come back within a heartbeat). ``pooling``: ``session`` (a direct PostgreSQL or
    a session-pooling proxy) or ``transaction`` (PgBouncer's transaction pooling: consecutive
    transactions may reach different server connections, so nothing is kept in a session);
    default ``DEFERRAL_DATABASE_POOLING``. ``options`` go to ``create_engine``."""
    pooling = pooling or database_pooling()
    connect_args: dict[str, Any] = {}
    if pooling == TRANSACTION_POOLING:
        # Server-side prepared statements live in one server session, which the next
        # transaction may not reach (psycopg would prepare a statement at its second run).
        connect_args["prepare_threshold"] = None
    else:
        # Prepared at its second run, not its sixth (psycopg's default): the hot statements of a
        # just-started service are parsed and planned from scratch only once, not for its first
        # five resumes on each connection (idle_runs' first probes were the slowest then). A
        # statement run once (most of a CLI command's) is never prepared.
        connect_args["prepare_threshold"] = 1
    pooled = "poolclass" not in options  # a NullPool takes no pool settings
    if pooled:
        options["pool_size"] = pool_size
        # Last in, first out: a loop's transactions take the connection it just returned, whose
        # server session has its statements prepared and its caches warm. First in, first out
        # spread them over every connection a nested session ever opened: each connection
        # prepared a statement only after N times as many runs, and N sessions stayed warm.
        options.setdefault("pool_use_lifo", True)
    if timeout_sec is not None:
        connect_args["connect_timeout"] = max(1, math.ceil(timeout_sec))
        if pooled:
            options.setdefault("pool_timeout", timeout_sec)
        if pooling != TRANSACTION_POOLING:
            connect_args["options"] = f"-c statement_timeout={_millis(timeout_sec)}"
    # No pre-ping: it costs a round trip per transaction. A connection that went stale (the
    # server restarted) fails its statement with a transient error, is invalidated, and the
    # work is retried on a fresh one.
    engine = create_engine(database_url, connect_args=connect_args, **options)
    if pooling != TRANSACTION_POOLING:
        # (No prepared statements to keep behind a transaction-pooling proxy.)
        engine.dialect.do_rollback = _rollback_keeping_prepared  # type: ignore[method-assign]
    event.listen(engine, "handle_error", _standby_is_a_disconnect)
    if pooling != TRANSACTION_POOLING:
        event.listen(engine, "connect", _without_jit)
    if timeout_sec is not None and pooling == TRANSACTION_POOLING:
        # A startup option would set it on one server session (and PgBouncer refuses startup
        # options): set it in each transaction instead, for that transaction only.
        timeout = f"SET LOCAL statement_timeout = {_millis(timeout_sec)}"

        @event.listens_for(engine, "begin")
        def _statement_timeout(conn: Connection) -> None:
            conn.exec_driver_sql(timeout)

    return engine


def _without_jit(dbapi_connection: Any, _record: Any) -> None:
    """Turn JIT compilation off for the new connection's session (deferral rule 114): the
    planner's cost of a hot statement grows with its tables (a subquery never run counts too),
    and past ``jit_above_cost`` each execution was compiled first, hundreds of times its own
    time. A statement of the session, not a startup option, which PgBouncer refuses; behind a
    transaction-pooling proxy a session setting does not hold, and the operator sets it for the
    role or database (docs/operations.md)."""
    result = dbapi_connection.pgconn.exec_(b"SET jit = off")
    if result.status != pq.ExecStatus.COMMAND_OK:
        raise psycopg.OperationalError(f"SET jit = off failed: {result.error_message!r}")


def _standby_is_a_disconnect(context: ExceptionContext) -> None:
    """A write refused as read-only means this connection reached a standby: the server it was
    opened on was demoted (a switchover). Dropped with the pool, like a broken connection, so
    that the retry connects anew and finds the primary (``target_session_attrs=read-write``);
    kept, it would be refused for ever."""
    orig = context.original_exception
    if isinstance(orig, psycopg.Error) and orig.sqlstate == READ_ONLY_SQL_TRANSACTION:
        context.is_disconnect = True


def _rollback_keeping_prepared(dbapi_connection: Any) -> None:
    """End a transaction without forgetting the connection's prepared statements.

    psycopg deallocates every statement it prepared whenever ``rollback()`` ends a transaction,
    and forgets how often each ran (a guard against a statement whose result a rolled-back DDL
    changed; PostgreSQL re-plans a statement whose tables changed, and the schema changes only
    by migrations, run with the services stopped). Every read-only session ends in a rollback,
    and the services open several a second, so their hot statements never reached the run at
    which psycopg prepares them: each was parsed and planned anew (a third of a resume
    transaction's time). ROLLBACK goes through libpq, whose state psycopg's connection reads;
    one that fails is left to psycopg's own rollback, which raises the error."""
    pgconn = dbapi_connection.pgconn
    if pgconn.transaction_status == pq.TransactionStatus.IDLE:
        return
    if pgconn.exec_(b"ROLLBACK").status != pq.ExecStatus.COMMAND_OK:
        dbapi_connection.rollback()


def _millis(seconds: float) -> int:
    return max(1, round(seconds * 1000))


def make_sessionmaker(engine: Engine) -> sessionmaker[Session]:
    return sessionmaker(engine, expire_on_commit=False)


@contextmanager
def one_statement(sessions: sessionmaker[Session]) -> Iterator[Session]:
    """A session whose statements commit each on its own (autocommit), for work that is one
    statement: atomic as it is, it needs no BEGIN and no COMMIT, two round trips fewer (on the
    hot paths, each a wake of the client and of its server process; benchmarks/README.md has the
    figures). A second statement in it would
    commit apart from the first: run what must be atomic with more in ``sessions.begin()``."""
    with sessions() as session:
        session.connection(execution_options={"isolation_level": "AUTOCOMMIT"})
        yield session


def location(engine: Engine) -> str:
    """host:port/database of an engine, without credentials, for messages."""
    return url_location(engine.url)


def url_location(url: URL) -> str:
    """host:port/database of a database URL, without credentials (a Unix socket's directory for
    its host), for messages."""
    hosts = url.query.get("host")
    if isinstance(hosts, tuple):  # several servers (failover): each host:port given
        return f"{','.join(hosts)}/{url.database}"
    host = url.host or hosts or "localhost"
    return f"{host}:{url.port or 5432}/{url.database}"


def unreachable(sessions: sessionmaker[Session]) -> str | None:
    """Why the database of ``sessions`` does not answer (its error's first line), or None."""
    try:
        with sessions() as session:
            session.execute(text("SELECT 1"))
    except SQLAlchemyError as exc:
        if not is_transient(exc):
            raise
        return first_line(exc)
    return None


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
                log.warning(
                    "PostgreSQL at %s is unreachable (%s); waiting for it",
                    location(engine),
                    first_line(exc),
                )
                said = True
            stop.wait(delay)
            delay = min(delay * 2, 5.0)
            continue
        if said:
            log.info("PostgreSQL at %s is up", location(engine))
        return True
    return False


_PSYCOPG_DIALECT = postgresql_psycopg.dialect()


@lru_cache(maxsize=64)
def _driver_sql(statement: TextClause) -> str:
    """A ``text()`` statement as psycopg takes it (``%(name)s`` parameters, ``%`` doubled)."""
    return str(statement.compile(dialect=_PSYCOPG_DIALECT))


def pipelined(
    session: Session, statements: Sequence[tuple[TextClause, Mapping[str, Any]]]
) -> list[list[Any]]:
    """Run ``statements`` in ``session``'s transaction, in order, sent together (libpq's
    pipeline mode): one round trip for all of them and for the BEGIN that opens the
    transaction, where each would otherwise wait for the one before. Each still runs on its
    own snapshot, after the one before has finished (a lock taken by one holds for the next).
    Returns each one's rows (named tuples). An error leaves the transaction to roll back; a
    connection lost on the way is dropped from the pool, as SQLAlchemy drops one it sees lost."""
    connection = session.connection()
    raw: psycopg.Connection[Any] = connection.connection.driver_connection  # type: ignore[assignment]
    cursors = []
    try:
        with raw.pipeline():
            for statement, params in statements:
                cursor = raw.cursor(row_factory=namedtuple_row)
                cursor.execute(_driver_sql(statement), params)
                cursors.append(cursor)
        return [cursor.fetchall() if cursor.description else [] for cursor in cursors]
    except psycopg.Error:
        if raw.closed or raw.broken:
            connection.invalidate()
        raise
