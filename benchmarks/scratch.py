"""A throw-away deployment for the scripts in this folder: its own database (created, migrated,
then dropped) and stream prefix on the test servers (DEFERRAL_TEST_ADMIN_URL /
DEFERRAL_TEST_REDIS_URL, local ones by default), exported as DEFERRAL_* settings so that
``deferral_cli.embedded.running_services`` starts services on it."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import redis
from cryptography.fernet import Fernet
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url

from deferral.store import migrate

ADMIN_URL = os.environ.get(
    "DEFERRAL_TEST_ADMIN_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
)
REDIS_URL = os.environ.get("DEFERRAL_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")


@contextmanager
def scratch_deployment(dags_folder: Path, kind: str) -> Iterator[str]:
    """Settings for a new database and stream prefix named ``deferral_<kind>_<random>`` in
    os.environ; yields the database URL; drops the database and the prefix's keys after."""
    name = f"deferral_{kind}_{uuid.uuid4().hex[:8]}"
    admin = create_engine(ADMIN_URL, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    url = make_url(ADMIN_URL).set(database=name).render_as_string(hide_password=False)
    os.environ.update(
        DEFERRAL_DATABASE_URL=url,
        DEFERRAL_REDIS_URL=REDIS_URL,
        DEFERRAL_FERNET_KEY=Fernet.generate_key().decode(),
        DEFERRAL_DAGS_FOLDER=str(dags_folder),
        DEFERRAL_STREAM_PREFIX=name,
    )
    try:
        migrate.upgrade(url)
        yield url
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()
        client = redis.Redis.from_url(REDIS_URL)
        keys = list(client.scan_iter(match=f"{name}:*"))
        if keys:
            client.delete(*keys)
        client.close()
