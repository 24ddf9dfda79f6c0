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
