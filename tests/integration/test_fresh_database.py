"""The tests' throw-away databases are dropped however their generator ends (in the background:
gone once ``wait_for_drops`` returns, as at the session's end)."""

from __future__ import annotations

from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url

from tests.conftest import fresh_database, wait_for_drops
from tests.servers import ADMIN_URL


def _exists(name: str) -> bool:
    admin = create_engine(ADMIN_URL)
    try:
        with admin.connect() as conn:
            found = conn.scalar(text("SELECT 1 FROM pg_database WHERE datname = :n"), {"n": name})
    finally:
        admin.dispose()
    return found is not None


def test_a_database_closed_at_its_yield_is_dropped() -> None:
    databases = fresh_database("deferral_test_closed")
    name = make_url(next(databases)).database
    assert name and _exists(name)
    databases.close()  # as a test that takes the first URL and closes the rest
    wait_for_drops()
    assert not _exists(name)
