"""Messages name the database by host:port/database, without credentials."""

from __future__ import annotations

from sqlalchemy.engine import make_url

from deferral.store.db import url_location


def test_a_failover_url_names_every_server() -> None:
    url = make_url(
        "postgresql+psycopg://u:secret@/deferral?host=pg-a:5432&host=pg-b:5433"
        "&target_session_attrs=read-write"
    )
    assert url_location(url) == "pg-a:5432,pg-b:5433/deferral"


def test_one_server_and_a_socket_directory() -> None:
    assert url_location(make_url("postgresql+psycopg://u:secret@db:6432/x")) == "db:6432/x"
    socket = make_url("postgresql+psycopg://u@/x?host=/run/postgresql")
    assert url_location(socket) == "/run/postgresql:5432/x"
