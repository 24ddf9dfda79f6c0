"""Shared fixtures. Integration and end-to-end tests use real PostgreSQL and Redis (which ones:
tests/servers.py): the session creates, migrates and finally drops its own database; each test
gets its own stream prefix, and its keys are deleted afterwards.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from cryptography.fernet import Fernet
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session, sessionmaker

from broker.client import Broker
from deferral import migrate
from deferral.config import Settings, load_settings
from deferral.crypto import Cipher
from deferral.db import make_engine, make_sessionmaker
from tests.helpers import wait_for
from tests.servers import ADMIN_URL, REDIS_URL

# Tables cleared before each database test; pool keeps its seeded default_pool row.
TABLES = (
    "task_state_change, xcom, task_reschedule, resume_event, outbox, dag, import_error, worker, "
    "task_log, task_log_try, "
    "rendered_task_instance_fields, variable, connection, "
    'task_instance, trigger, triggerer, scheduler, dag_run, "user", web_session'
)

__all__ = ["wait_for"]


@pytest.fixture(scope="session")
def database_url() -> Iterator[str]:
    """A fresh database for this test session, migrated to head."""
    yield from fresh_database("deferral_test")


def fresh_database(prefix: str) -> Iterator[str]:
    """The URL of a new database (named ``prefix`` and a random suffix) migrated to head,
    dropped when the generator is closed."""
    name = f"{prefix}_{uuid.uuid4().hex[:10]}"
    admin = create_engine(ADMIN_URL, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    url = make_url(ADMIN_URL).set(database=name).render_as_string(hide_password=False)
    migrate.upgrade(url)
    yield url
    with admin.connect() as conn:
        conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    admin.dispose()


@pytest.fixture
def sessions(database_url: str) -> Iterator[sessionmaker[Session]]:
    """A sessionmaker on the test database, emptied before the test."""
    engine = make_engine(database_url)
    with engine.begin() as conn:
        conn.execute(text(f"TRUNCATE {TABLES} RESTART IDENTITY CASCADE"))
    yield make_sessionmaker(engine)
    engine.dispose()


@pytest.fixture(scope="session")
def fernet_key() -> str:
    return Fernet.generate_key().decode()


@pytest.fixture
def cipher(fernet_key: str) -> Cipher:
    return Cipher([fernet_key])


@pytest.fixture
def stream_prefix() -> str:
    return f"deferral_test_{uuid.uuid4().hex[:10]}"


@pytest.fixture
def broker(stream_prefix: str) -> Iterator[Broker]:
    """A broker on a prefix of its own; every key under it is deleted afterwards."""
    broker = Broker.from_url(REDIS_URL, stream_prefix)
    yield broker
    keys = list(broker.redis.scan_iter(match=f"{stream_prefix}:*"))
    if keys:
        broker.redis.delete(*keys)
    broker.close()


@pytest.fixture
def dags_folder(tmp_path: Path) -> Path:
    folder = tmp_path / "dags"
    folder.mkdir()
    return folder


@pytest.fixture
def service_env(
    database_url: str, fernet_key: str, stream_prefix: str, dags_folder: Path
) -> dict[str, str]:
    """DEFERRAL_* variables pointing at the test database, Redis prefix and DAGs folder."""
    return {
        "DEFERRAL_DATABASE_URL": database_url,
        "DEFERRAL_REDIS_URL": REDIS_URL,
        "DEFERRAL_FERNET_KEY": fernet_key,
        "DEFERRAL_DAGS_FOLDER": str(dags_folder),
        "DEFERRAL_STREAM_PREFIX": stream_prefix,
        "DEFERRAL_HEARTBEAT_SEC": "1",
    }


@pytest.fixture
def settings(service_env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> Settings:
    """Settings for in-process services; also exported to os.environ for code that reads it."""
    for key, value in service_env.items():
        monkeypatch.setenv(key, value)
    return load_settings(service_env, toml_path=Path("/nonexistent"))


@pytest.fixture
def write_dag(dags_folder: Path) -> Callable[[str, str], Path]:
    """Write a DAG file into the test's DAGs folder (module names are unique per test)."""

    def write(name: str, source: str) -> Path:
        path = dags_folder / f"{name}.py"
        path.write_text(source)
        return path

    return write


def pytest_report_header(config: Any) -> str:
    return f"deferral test servers: postgres {make_url(ADMIN_URL)!r}, redis {REDIS_URL}"
