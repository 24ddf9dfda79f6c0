"""A service's hot statements stay prepared across the read-only sessions between them (psycopg
forgets its prepared statements on every rollback, and a session that only reads ends in one),
are prepared from their second run, and stay on the connection a loop keeps taking."""

from __future__ import annotations

import pytest
from sqlalchemy import text
from sqlalchemy.exc import OperationalError, ProgrammingError

from deferral.store.db import make_engine, make_sessionmaker

HOT = text("SELECT 1 AS hot_statement_marker WHERE CAST(:n AS integer) >= 0")
PREPARED = text(
    "SELECT count(*) FROM pg_prepared_statements WHERE statement LIKE '%hot_statement_marker%'"
)


def test_a_statement_run_between_rolled_back_sessions_is_prepared(database_url: str) -> None:
    sessions = make_sessionmaker(make_engine(database_url, pool_size=1))
    for n in range(8):
        with sessions.begin() as session:
            session.execute(HOT, {"n": n})
        with sessions() as session:  # reads only, then rolls back on close
            session.execute(text("SELECT 1"))
    with sessions() as session:
        assert session.scalar(PREPARED) == 1


def test_a_statement_is_prepared_at_its_second_run_on_the_connection_just_returned(
    database_url: str,
) -> None:
    sessions = make_sessionmaker(make_engine(database_url, pool_size=3))
    # Three connections open at once, then one session after another: each takes the
    # connection returned last (first in, first out spread them over all three).
    with sessions() as a, sessions() as b, sessions() as c:
        for session in (a, b, c):
            session.execute(text("SELECT 1"))
    pids = set()
    for n in range(2):
        with sessions.begin() as session:
            pids.add(session.scalar(text("SELECT pg_backend_pid()")))
            session.execute(HOT, {"n": n})
    assert len(pids) == 1
    with sessions() as session:
        assert session.scalar(PREPARED) == 1


def test_a_failed_transaction_still_rolls_back(database_url: str) -> None:
    sessions = make_sessionmaker(make_engine(database_url, pool_size=1))
    with sessions() as session:
        with pytest.raises(ProgrammingError):
            session.execute(text("SELECT * FROM no_such_table"))
        session.rollback()
        assert session.scalar(text("SELECT 41 + 1")) == 42


def test_a_rollback_on_a_lost_connection_raises_and_the_pool_replaces_it(database_url: str) -> None:
    # ROLLBACK through libpq fails on a dead connection: psycopg's own rollback must then raise,
    # so that SQLAlchemy drops the connection instead of handing it out again.
    engine = make_engine(database_url, pool_size=1)
    sessions = make_sessionmaker(engine)
    admin = make_engine(database_url, pool_size=1)
    with pytest.raises(OperationalError) as raised, sessions() as session:
        lost = session.scalar(text("SELECT pg_backend_pid()"))
        with admin.begin() as conn:
            conn.execute(text("SELECT pg_terminate_backend(:pid)"), {"pid": lost})
    assert raised.value.connection_invalidated
    with sessions() as session:
        assert session.scalar(text("SELECT pg_backend_pid()")) != lost
