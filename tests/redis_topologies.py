"""Real Redis Cluster and Sentinel topologies, and a lone Redis to stop, on loopback ports,
started and stopped by tests (``redis-server``/``redis-cli`` from the PATH; nothing downloaded).

:class:`LocalCluster` is 3 primaries and 3 replicas made with ``redis-cli --cluster create
--cluster-replicas 1``; :class:`LocalSentinel` one primary, one replica and three sentinels.
Both give the ``DEFERRAL_REDIS_URL`` that selects them and can kill -9 a primary.
:class:`LocalRedis` is one server with AOF (``appendfsync everysec``) to kill, stop, restart
with or without its data, and fill (``maxmemory`` with ``noeviction``).
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import TypeVar

import redis

from tests.helpers import wait_for


def redis_binaries_found() -> bool:
    return shutil.which("redis-server") is not None and shutil.which("redis-cli") is not None


def free_ports(count: int, *, bus: bool = False) -> list[int]:
    """``count`` loopback ports free now (with port + 10000 free too when ``bus``), looked for
    from a point of this process's own, so that two test lanes rarely race for one port."""
    ports: list[int] = []
    probe = 20000 + random.Random(os.getpid()).randrange(0, 20000, 100)
    while len(ports) < count:
        probe += 7
        candidates = [probe, probe + 10000] if bus else [probe]
        if all(_free(p) for p in candidates):
            ports.append(probe)
    return ports


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


class _Servers:
    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.procs: dict[int, subprocess.Popen[bytes]] = {}

    def start(self, port: int, *config: str, conf: Path | None = None) -> None:
        folder = self.workdir / str(port)
        folder.mkdir(parents=True, exist_ok=True)
        argv = [
            "redis-server",
            *([str(conf)] if conf else []),
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--dir",
            str(folder),
            "--save",
            "",
            "--appendonly",
            "no",
            "--protected-mode",
            "no",
            # A replica's first sync starts at once, not after the default 5 s wait for more
            # replicas: a primary killed in those seconds would leave a replica that may not
            # take over ("disconnected from master for longer than allowed").
            "--repl-diskless-sync-delay",
            "0",
            *config,
        ]
        log = (folder / "server.log").open("ab")
        self.procs[port] = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
        wait_for(lambda: _answers(port), timeout=30, what=f"redis on {port}")

    def kill(self, port: int, signum: signal.Signals = signal.SIGKILL) -> None:
        """kill -9 (or ``signum``: SIGTERM saves and exits) the server on ``port``."""
        proc = self.procs[port]
        proc.send_signal(signum)
        proc.wait()

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _answers(port: int) -> bool:
    client = redis.Redis(port=port, socket_timeout=2)
    try:
        return bool(client.ping())
    except redis.RedisError:
        return False
    finally:
        client.close()


def _replication(port: int) -> dict[str, object]:
    """``INFO replication`` of the server on ``port``; empty when it does not answer."""
    client = redis.Redis(port=port, socket_timeout=2)
    try:
        return dict(client.info("replication"))
    except redis.RedisError:
        return {}
    finally:
        client.close()


def _role(port: int) -> str:
    return str(_replication(port).get("role", "down"))


def _link_up(port: int) -> bool:
    return _replication(port).get("master_link_status") == "up"


class LocalCluster:
    """3 primaries, 3 replicas (``--cluster-enabled yes``), failover after 1 s unreachable."""

    def __init__(self, workdir: Path) -> None:
        self.servers = _Servers(workdir)
        self.ports = free_ports(6, bus=True)

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(f"127.0.0.1:{p}" for p in self.ports)

    def start(self) -> LocalCluster:
        for port in self.ports:
            self.servers.start(
                port,
                "--cluster-enabled",
                "yes",
                "--cluster-config-file",
                "nodes.conf",
                "--cluster-node-timeout",
                "1000",
            )
        subprocess.run(
            [
                "redis-cli",
                "--cluster",
                "create",
                *(f"127.0.0.1:{p}" for p in self.ports),
                "--cluster-replicas",
                "1",
                "--cluster-yes",
            ],
            check=True,
            capture_output=True,
            timeout=120,
        )
        wait_for(self._ok, timeout=120, what="the cluster to be ok")
        wait_for(self._replicas_synced, timeout=120, what="every replica to sync")
        return self

    def _replicas_synced(self) -> bool:
        """Each replica has its primary's data (only a synced replica can be promoted)."""
        replicas = [info for info in map(_replication, self.ports) if info.get("role") == "slave"]
        return len(replicas) == 3 and all(i.get("master_link_status") == "up" for i in replicas)

    def _ok(self) -> bool:
        """The cluster says ok to a node still running, and three primaries run."""
        live = [p for p in self.ports if self.servers.procs[p].poll() is None]
        client = redis.Redis(port=live[0], socket_timeout=2)
        try:
            info = client.cluster("info")
        except redis.RedisError:
            return False
        finally:
            client.close()
        return str(info.get("cluster_state")) == "ok" and len(self.primaries()) == 3

    def primaries(self) -> list[int]:
        return [
            p for p in self.ports if self.servers.procs[p].poll() is None and _role(p) == "master"
        ]

    def kill_primary(self, port: int) -> None:
        """kill -9 the primary on ``port`` and wait until its replica is promoted."""
        self.servers.kill(port)
        wait_for(self._ok, timeout=120, what="a replica to be promoted")

    def keys(self, pattern: str) -> dict[int, list[str]]:
        """``redis-cli --scan --pattern`` on each primary: its keys."""
        found = {}
        for port in self.primaries():
            out = subprocess.run(
                ["redis-cli", "-c", "-p", str(port), "--scan", "--pattern", pattern],
                check=True,
                capture_output=True,
                text=True,
                timeout=60,
            ).stdout
            found[port] = out.split()
        return found

    def stop(self) -> None:
        self.servers.stop()


class LocalSentinel:
    """One primary, one replica, three sentinels (quorum 2) watching service ``deferral``."""

    SERVICE = "deferral"

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.servers = _Servers(workdir)
        self.primary, self.replica, *self.sentinels = free_ports(5)

    @property
    def url(self) -> str:
        hosts = ",".join(f"127.0.0.1:{p}" for p in self.sentinels)
        return f"redis+sentinel://{hosts}/{self.SERVICE}"

    def start(self) -> LocalSentinel:
        self.servers.start(self.primary)
        self.servers.start(self.replica, "--replicaof", "127.0.0.1", str(self.primary))
        wait_for(lambda: _link_up(self.replica), timeout=120, what="the replica to sync")
        for port in self.sentinels:
            conf = self.workdir / f"sentinel-{port}.conf"
            conf.write_text(
                "protected-mode no\n"
                f"sentinel monitor {self.SERVICE} 127.0.0.1 {self.primary} 2\n"
                f"sentinel down-after-milliseconds {self.SERVICE} 1000\n"
                f"sentinel failover-timeout {self.SERVICE} 5000\n"
            )
            self.servers.start(port, "--sentinel", conf=conf)
        return self

    def promoted(self) -> bool:
        return _role(self.replica) == "master"

    def kill_primary(self) -> None:
        self.servers.kill(self.primary)
        wait_for(self.promoted, timeout=120, what="sentinels to promote the replica")

    def stop(self) -> None:
        self.servers.stop()


class LocalRedis:
    """One Redis with AOF (``appendfsync everysec``) and ``maxmemory-policy noeviction``, whose
    outages a test makes: :meth:`down` (kill -9, or SIGTERM), :meth:`up` (with the data it had on
    disk, or with none), :meth:`full` (writes refused: ``maxmemory`` below what it uses)."""

    def __init__(self, workdir: Path) -> None:
        self.servers = _Servers(workdir)
        (self.port,) = free_ports(1)
        self.folder = workdir / str(self.port)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> LocalRedis:
        self.up()
        return self

    def down(self, signum: signal.Signals = signal.SIGKILL) -> None:
        self.servers.kill(self.port, signum)

    def up(self, *, data: bool = True) -> None:
        """Start it again; ``data=False``: its files deleted first, as a server that lost them."""
        if not data:
            shutil.rmtree(self.folder / "appendonlydir", ignore_errors=True)
            (self.folder / "dump.rdb").unlink(missing_ok=True)
        self.servers.start(
            self.port,
            "--appendonly",
            "yes",
            "--appendfsync",
            "everysec",
            "--maxmemory-policy",
            "noeviction",
        )

    def written(self) -> None:
        """Wait until what it acknowledged is written to its AOF (``aof_buffer_length`` 0: a
        kill -9 of the process keeps what the file has; with ``everysec`` a write can wait up
        to two seconds behind a slow fsync)."""
        client = redis.Redis(port=self.port, socket_timeout=5)
        try:
            wait_for(
                lambda: client.info("persistence")["aof_buffer_length"] == 0,
                timeout=30,
                what="the AOF buffer written",
            )
        finally:
            client.close()

    def full(self, refuse: bool = True) -> None:
        """``maxmemory`` 1 byte (every write refused, OOM), or none again."""
        client = redis.Redis(port=self.port, socket_timeout=5)
        try:
            client.config_set("maxmemory", "1" if refuse else "0")
        finally:
            client.close()

    def stop(self) -> None:
        self.servers.stop()


Topology = TypeVar("Topology", LocalCluster, LocalSentinel, LocalRedis)


def running(topology: Topology) -> Iterator[Topology]:
    """``topology`` started for a fixture's lifetime and stopped after it, also when starting it
    fails half way (the servers already started are killed, not left on their ports)."""
    try:
        yield topology.start()
    finally:
        topology.stop()
