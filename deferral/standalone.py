"""``deferral standalone``: every service in one command, for trying deferral out.

Settings that are not given get local defaults (Postgres and Redis on 127.0.0.1, a demo
database created on first use, a Fernet key generated once and kept in ``.deferral/``), so the
one command works against a developer machine's local servers.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from cryptography.fernet import Fernet
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url

DEFAULT_DATABASE_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/deferral_demo"
DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
KEY_FILE = Path(".deferral") / "fernet.key"
SERVICES = (("scheduler",), ("triggerer",), ("worker", "--concurrency", "4"))


def _fernet_key() -> str:
    if KEY_FILE.exists():
        return KEY_FILE.read_text().strip()
    KEY_FILE.parent.mkdir(exist_ok=True)
    key = Fernet.generate_key().decode()
    KEY_FILE.write_text(key + "\n")
    KEY_FILE.chmod(0o600)
    return key


def _create_database(url: str) -> None:
    """Create the database of ``url`` if it does not exist yet."""
    target = make_url(url)
    admin = create_engine(target.set(database="postgres"), isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        exists = conn.scalar(
            text("SELECT 1 FROM pg_database WHERE datname = :name"), {"name": target.database}
        )
        if not exists:
            conn.execute(text(f'CREATE DATABASE "{target.database}"'))
    admin.dispose()


def prepare_environment(dags_folder: str | None) -> None:
    """Fill in local defaults for unset settings, in os.environ (children inherit it)."""
    if "DEFERRAL_DATABASE_URL" not in os.environ:
        os.environ["DEFERRAL_DATABASE_URL"] = DEFAULT_DATABASE_URL
        _create_database(DEFAULT_DATABASE_URL)
    os.environ.setdefault("DEFERRAL_REDIS_URL", DEFAULT_REDIS_URL)
    if "DEFERRAL_FERNET_KEY" not in os.environ:
        os.environ["DEFERRAL_FERNET_KEY"] = _fernet_key()
    if dags_folder is not None:
        os.environ["DEFERRAL_DAGS_FOLDER"] = str(Path(dags_folder).resolve())


@contextmanager
def running_services() -> Iterator[list[subprocess.Popen[bytes]]]:
    """Start scheduler, triggerer and worker as child processes; SIGTERM them on the way out."""
    procs = [
        subprocess.Popen([sys.executable, "-m", name, "consume", *args]) for name, *args in SERVICES
    ]
    try:
        yield procs
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
