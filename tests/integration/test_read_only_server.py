"""A connection whose server refuses writes as read-only (it was demoted to a standby in a
switchover) is a transient error and is dropped, so that the retry connects anew."""

from __future__ import annotations

import pytest
from sqlalchemy import text
from sqlalchemy.exc import DBAPIError

from deferral.runtime.faults import is_transient
from deferral.store.db import make_engine


def test_a_write_refused_as_read_only_drops_the_connection(database_url: str) -> None:
    engine = make_engine(database_url, pool_size=1)
    try:
        with engine.connect() as conn:
            before = conn.scalar(text("SELECT pg_backend_pid()"))
            # As a demoted server would answer every later write on this connection.
            conn.exec_driver_sql("SET SESSION CHARACTERISTICS AS TRANSACTION READ ONLY")
            conn.commit()
        with pytest.raises(DBAPIError) as refused, engine.begin() as conn:
            conn.execute(text("CREATE TABLE refused_as_read_only (x int)"))
        assert is_transient(refused.value)
        assert refused.value.connection_invalidated
        with engine.begin() as conn:
            after = conn.scalar(text("SELECT pg_backend_pid()"))
            conn.execute(text("CREATE TEMP TABLE written_again (x int)"))
        assert after != before
    finally:
        engine.dispose()
