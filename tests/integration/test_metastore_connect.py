"""A task process's metastore against a real PostgreSQL that is not listening yet: its first
session waits for the server instead of failing the task's try (deferral/DECISIONS.md 107)."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator

import pytest
from sqlalchemy import text
from sqlalchemy.engine import make_url
from sqlalchemy.exc import OperationalError

from deferral.store import metastore

# The proxy to PostgreSQL begins listening this long after the first session is asked for.
LATE_SEC = 1.0


def _pipe(source: socket.socket, sink: socket.socket) -> None:
    with contextlib.suppress(OSError):
        while data := source.recv(65536):
            sink.sendall(data)
    with contextlib.suppress(OSError):
        sink.shutdown(socket.SHUT_WR)


@contextlib.contextmanager
def _late_proxy(port: int, to: tuple[str, int]) -> Iterator[threading.Event]:
    """A TCP proxy on ``port`` to ``to`` that starts listening LATE_SEC from now (connections
    before that are refused); the event is set once it listens."""
    listening, stop = threading.Event(), threading.Event()

    def serve() -> None:
        stop.wait(LATE_SEC)  # the fault: nothing listens on the port until then
        with socket.create_server(("127.0.0.1", port)) as server:
            server.settimeout(0.2)
            listening.set()
            while not stop.is_set():
                try:
                    client, _ = server.accept()
                except TimeoutError:
                    continue
                upstream = socket.create_connection(to)
                for a, b in ((client, upstream), (upstream, client)):
                    threading.Thread(target=_pipe, args=(a, b), daemon=True).start()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield listening
    finally:
        stop.set()
        thread.join(timeout=10)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def test_the_first_session_waits_for_a_server_not_listening_yet(
    database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(metastore, "_patience", metastore.CONNECT_PATIENCE_SEC)  # a task process
    url = make_url(database_url)
    port = _free_port()
    with _late_proxy(port, (url.host or "127.0.0.1", url.port or 5432)) as listening:
        store = metastore._open(
            url.set(port=port).render_as_string(hide_password=False), ("x" * 43 + "=",)
        )
        started = time.monotonic()
        with store.sessions() as session:
            assert session.execute(text("SELECT 1")).scalar() == 1
        assert listening.is_set()
        assert time.monotonic() - started >= LATE_SEC * 0.9  # it did wait


def test_a_command_says_at_once_that_the_server_does_not_answer(database_url: str) -> None:
    """Outside a task process a refused connect is an error at once (the CLI's one line)."""
    url = make_url(database_url).set(port=_free_port())
    store = metastore._open(url.render_as_string(hide_password=False), ("y" * 43 + "=",))
    started = time.monotonic()
    with pytest.raises(OperationalError), store.sessions() as session:
        session.execute(text("SELECT 1"))
    assert time.monotonic() - started < LATE_SEC
