"""Statements sent together (``db.pipelined``): each runs after the one before, in the
session's transaction, with its own rows; an error leaves the transaction to roll back, and a
connection lost on the way is not handed out again."""

from __future__ import annotations

import psycopg
import pytest
from sqlalchemy import text

from deferral.store.db import make_engine, make_sessionmaker, pipelined

LOCK = text("SELECT 1 AS locked FROM (SELECT pg_advisory_xact_lock(CAST(:key AS bigint))) AS l")
HELD = text(
    "SELECT count(*) AS held, txid_current() AS tx FROM pg_locks"
    " WHERE locktype = 'advisory' AND objid = CAST(:key AS bigint) AND pid = pg_backend_pid()"
)


def test_each_statement_runs_after_the_one_before_in_one_transaction(database_url: str) -> None:
    sessions = make_sessionmaker(make_engine(database_url, pool_size=1))
    with sessions.begin() as session:
        locked, held, empty = pipelined(
            session,
            [
                (LOCK, {"key": 4242}),
                (HELD, {"key": 4242}),
                (text("SELECT 1 AS one WHERE false"), {}),
            ],
        )
        assert [row.locked for row in locked] == [1]
        assert [row.held for row in held] == [1]  # the first statement's lock, still held
        assert empty == []
        assert session.scalar(text("SELECT txid_current()")) == held[0].tx
    with sessions() as session:  # the transaction's end released it
        assert session.execute(HELD, {"key": 4242}).one().held == 0


def test_an_error_leaves_the_transaction_to_roll_back(database_url: str) -> None:
    sessions = make_sessionmaker(make_engine(database_url, pool_size=1))
    with sessions() as session:
        with pytest.raises(psycopg.errors.UndefinedTable):
            pipelined(
                session,
                [(text("SELECT 1 AS one"), {}), (text("SELECT * FROM no_such_table"), {})],
            )
        session.rollback()
        assert session.scalar(text("SELECT 41 + 1")) == 42


def test_a_connection_lost_on_the_way_is_replaced(database_url: str) -> None:
    engine = make_engine(database_url, pool_size=1)
    sessions = make_sessionmaker(engine)
    with sessions() as session:
        pid = session.scalar(text("SELECT pg_backend_pid()"))
        session.rollback()
        with make_engine(database_url, pool_size=1).connect() as other:
            other.execute(text("SELECT pg_terminate_backend(:pid)"), {"pid": pid})
        with pytest.raises(psycopg.OperationalError):
            pipelined(session, [(text("SELECT 1 AS one"), {})])
        session.rollback()
    with sessions() as session:
        assert session.scalar(text("SELECT pg_backend_pid()")) != pid
