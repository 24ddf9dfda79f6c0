"""A private PostgreSQL cluster on loopback ports, for the tests and benchmarks that stop it (the
shared server on 5432 must keep running for everyone else).

:class:`LocalPostgres` is a primary (``initdb``, trust authentication, fsync off: nothing here
outlives the machine, and ``synchronous_commit`` stays on, so a commit still waits for its WAL
write and survives an immediate shutdown), optionally with a streaming replica made by
``pg_basebackup -R``. It stops the primary (``immediate``: as a crash; ``fast``), starts it
again, and promotes the replica. The binaries are Debian's (``/usr/lib/postgresql/<version>/bin``,
the newest), else ``pg_config --bindir``'s; run as root, they run as the ``postgres`` user
(initdb refuses root).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

from sqlalchemy import create_engine, text

from tests.helpers import wait_for
from tests.redis_topologies import free_ports

DEBIAN_VERSIONS = Path("/usr/lib/postgresql")  # <version>/bin, as Debian's packages install


def bindir() -> Path | None:
    """The directory of initdb/pg_ctl/pg_basebackup (Debian's newest version, else
    ``pg_config --bindir``'s), or None if there is none on this machine."""
    versions = [p for p in DEBIAN_VERSIONS.glob("*/bin") if p.parent.name.isdigit()]
    newest_first = sorted(versions, key=lambda p: int(p.parent.name), reverse=True)
    for folder in (*newest_first, _pg_config_bindir()):
        if folder is not None and (folder / "initdb").exists():
            return folder
    return None


def _pg_config_bindir() -> Path | None:
    if shutil.which("pg_config") is None:
        return None
    found = subprocess.run(["pg_config", "--bindir"], capture_output=True, text=True, check=False)
    return Path(found.stdout.strip()) if found.returncode == 0 else None


def _as_owner() -> list[str]:
    """The prefix that runs a PostgreSQL binary as a user it accepts (not root)."""
    return ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []


class LocalPostgres:
    """A primary (and, with ``replica``, a streaming replica) on free loopback ports."""

    def __init__(self, *, replica: bool = False) -> None:
        found = bindir()
        assert found is not None, "no PostgreSQL binaries (initdb) on this machine"
        self.bin = found
        self.with_replica = replica
        self.primary_port, self.replica_port = free_ports(2)
        self.home = Path(tempfile.mkdtemp(prefix="deferral-pg-"))
        self.home.chmod(0o755)  # the postgres user reaches its data directories through it

    def _folder(self, port: int) -> Path:
        return self.home / str(port)

    def _run(self, program: str, *args: str, timeout: float = 120) -> None:
        argv = [*_as_owner(), str(self.bin / program), *args]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"{program} {' '.join(args)} failed: {done.stderr or done.stdout}")

    def admin_url(self, port: int | None = None) -> str:
        return f"postgresql+psycopg://postgres@127.0.0.1:{port or self.primary_port}/postgres"

    @property
    def failover_url(self) -> str:
        """The admin URL naming both servers: psycopg connects to the one that takes writes."""
        hosts = "&".join(f"host=127.0.0.1:{p}" for p in (self.primary_port, self.replica_port))
        return f"postgresql+psycopg://postgres@/postgres?{hosts}&target_session_attrs=read-write"

    def start(self) -> LocalPostgres:
        data = self._folder(self.primary_port)
        if os.geteuid() == 0:
            shutil.chown(self.home, "postgres", "postgres")
        self._run("initdb", "-D", str(data), "--auth=trust", "-U", "postgres", "--no-sync")
        with (data / "postgresql.conf").open("a") as conf:
            conf.write(
                "fsync = off\nfull_page_writes = off\nmax_connections = 300\n"
                "listen_addresses = '127.0.0.1'\nunix_socket_directories = ''\n"
            )
        self.start_server(self.primary_port)
        if self.with_replica:
            self._run(
                "pg_basebackup",
                "-h",
                "127.0.0.1",
                "-p",
                str(self.primary_port),
                "-U",
                "postgres",
                "-D",
                str(self._folder(self.replica_port)),
                "-R",
                "-X",
                "stream",
            )
            self.start_server(self.replica_port)
            # Synchronous replication: a commit waits for the replica, so a failover keeps
            # every commit (with asynchronous replication the latest may be lost with the
            # primary, and nothing could be said of committed work).
            self._query(self.primary_port, "ALTER SYSTEM SET synchronous_standby_names = '*'")
            self._query(self.primary_port, "SELECT pg_reload_conf()")
            wait_for(self._synchronous, timeout=60, what="the replica to replicate synchronously")
        return self

    def _synchronous(self) -> bool:
        states = self._query(
            self.primary_port, "SELECT string_agg(sync_state, ',') FROM pg_stat_replication"
        )
        return states == "sync"

    def start_server(self, port: int) -> None:
        folder = self._folder(port)
        self._run(
            "pg_ctl",
            "start",
            "-w",
            "-D",
            str(folder),
            "-l",
            str(folder / "server.log"),
            "-o",
            f"-p {port}",
        )
        wait_for(lambda: self.answers(port), timeout=60, what=f"PostgreSQL on {port}")

    def stop_server(self, port: int, mode: str = "immediate") -> None:
        """``pg_ctl stop -m mode``: ``immediate`` ends every backend at once without a
        checkpoint (as a crash: the restart replays the WAL)."""
        self._run("pg_ctl", "stop", "-w", "-m", mode, "-D", str(self._folder(port)))

    def promote(self) -> None:
        """Promote the replica and wait until it takes writes."""
        self._run("pg_ctl", "promote", "-w", "-D", str(self._folder(self.replica_port)))
        wait_for(lambda: self.writable(self.replica_port), timeout=60, what="the promoted replica")

    def answers(self, port: int) -> bool:
        return self._query(port, "SELECT 1") is not None

    def writable(self, port: int) -> bool:
        return self._query(port, "SELECT NOT pg_is_in_recovery()") is True

    def _query(self, port: int, sql: str) -> object:
        """``sql``'s first value (autocommitted: ALTER SYSTEM runs outside a transaction),
        None if the server does not answer."""
        engine = create_engine(
            self.admin_url(port), connect_args={"connect_timeout": 2}, isolation_level="AUTOCOMMIT"
        )
        try:
            with engine.connect() as conn:
                result = conn.execute(text(sql))
                return result.scalar() if result.returns_rows else None
        except Exception:
            return None
        finally:
            engine.dispose()

    def stop(self) -> None:
        """Stop whatever runs and remove the data directories."""
        for port in (self.primary_port, self.replica_port):
            if (self._folder(port) / "postmaster.pid").exists():
                self.stop_server(port)
        shutil.rmtree(self.home, ignore_errors=True)


def running(cluster: LocalPostgres) -> Iterator[LocalPostgres]:
    """``cluster`` started for a fixture's lifetime and removed after it, also when starting it
    fails half way."""
    try:
        yield cluster.start()
    finally:
        cluster.stop()
