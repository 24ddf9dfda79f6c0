"""A service's hot statements stay prepared across the read-only sessions between them: psycopg
forgets its prepared statements on every rollback, and a session that only reads ends in one."""

from __future__ import annotations

import pytest
from sqlalchemy import text
from sqlalchemy.exc import ProgrammingError

from deferral.db import make_engine, make_sessionmaker

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


def test_a_failed_transaction_still_rolls_back(database_url: str) -> None:
    sessions = make_sessionmaker(make_engine(database_url, pool_size=1))
    with sessions() as session:
        with pytest.raises(ProgrammingError):
            session.execute(text("SELECT * FROM no_such_table"))
        session.rollback()
        assert session.scalar(text("SELECT 41 + 1")) == 42
