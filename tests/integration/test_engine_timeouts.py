"""An engine with a timeout comes back from a database that hangs: the triggerer's lease thread
records its heartbeat through one, and must be free for the next renewal within a heartbeat."""

from __future__ import annotations

import socket
import time

import pytest
from sqlalchemy import text
from sqlalchemy.engine import make_url
from sqlalchemy.exc import OperationalError

from deferral.store.db import make_engine


def test_a_statement_that_hangs_is_cancelled_after_the_timeout(database_url: str) -> None:
    engine = make_engine(database_url, pool_size=1, timeout_sec=0.5)
    try:
        with engine.connect() as conn:
            assert conn.execute(text("SHOW statement_timeout")).scalar() == "500ms"
            with pytest.raises(OperationalError, match="statement timeout"):
                conn.execute(text("SELECT pg_sleep(30)"))
    finally:
        engine.dispose()


def test_a_server_that_accepts_but_never_answers_times_the_connection_out(
    database_url: str,
) -> None:
    # A listening socket nobody accepts from: the TCP handshake completes, PostgreSQL's never.
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(1)
    url = make_url(database_url).set(host="127.0.0.1", port=silent.getsockname()[1])
    engine = make_engine(url.render_as_string(hide_password=False), timeout_sec=1)
    started = time.monotonic()
    try:
        with pytest.raises(OperationalError), engine.connect():
            pass
        # Bounded (the connect timeout), not for ever; generous for a loaded machine.
        assert time.monotonic() - started < 30
    finally:
        engine.dispose()
        silent.close()


# Estimated far above jit_above_cost and its inlining and optimizing thresholds (a billion
# rows), as a hot statement's cost grows with its tables; explained, not run.
_COSTLY = (
    "EXPLAIN (FORMAT JSON) SELECT count(*)"
    " FROM generate_series(1, 1000) a, generate_series(1, 1000) b, generate_series(1, 1000) c"
)


@pytest.mark.parametrize("timeout_sec", [None, 0.5])
def test_no_statement_is_jit_compiled_on_a_direct_connection(
    database_url: str, timeout_sec: float | None
) -> None:
    """deferral rule 114: a dispatch's pool count took 450 ms, 387 of them compiling, with
    1,000,000 tasks in the table; 0.7 ms without JIT."""
    engine = make_engine(database_url, pool_size=1, timeout_sec=timeout_sec)
    try:
        with engine.connect() as conn:
            assert conn.execute(text("SHOW jit")).scalar() == "off"
            (plan,) = conn.execute(text(_COSTLY)).scalar_one()
            assert "JIT" not in plan
            conn.execute(text("SET jit = on"))  # what the server would do by default
            (plan,) = conn.execute(text(_COSTLY)).scalar_one()
            assert "JIT" in plan
    finally:
        engine.dispose()
