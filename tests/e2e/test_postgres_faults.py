"""PostgreSQL goes away and comes back, under deferring tasks, through the real processes: an
immediate shutdown and restart, a few seconds stopped, a failover to a promoted replica.

One private cluster (a primary and a synchronous streaming replica, ``tests/postgres_topologies``)
and one stack serve the module's cases, in file order (the failover comes last: the old primary
stays down). The services are given both servers (``host=a&host=b``,
``target_session_attrs=read-write``), as a deployment that fails over must. Each case: every
task succeeded exactly once (``task_state_change`` and each task's own mark), no service died,
work resumed within RESUME_DEADLINE_SEC of the server's return.
"""

from __future__ import annotations

import datetime as dt
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session, sessionmaker

from deferral.store import migrate
from deferral.store.db import make_engine, make_sessionmaker
from tests.conftest import delete_stream_keys, new_stream_prefix
from tests.e2e.conftest import Services, _show_logs_if_failed
from tests.helpers import wait_for
from tests.outage_runs import (
    database_now,
    first_change_after,
    outage_dag,
    problems,
    reached,
    run_finished,
)
from tests.postgres_topologies import LocalPostgres, bindir, running
from tests.redis_topologies import free_ports
from tests.servers import REDIS_URL

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(bindir() is None, reason="no PostgreSQL binaries (initdb) here"),
]

N = 40
# Generous for a loaded machine; the benchmark measures the figure (postgres_faults.py).
RESUME_DEADLINE_SEC = 30.0
# Longer than the services' settling (two heartbeats of the stack's 1 s): each loop fails a few
# times and the outage is not over before the server returns.
OUTAGE_SEC = 3.0


@dataclass
class Faulted:
    """The module's cluster, database and services."""

    cluster: LocalPostgres
    services: Services
    sessions: sessionmaker[Session]
    out: Path
    dags: Path
    metrics_port: int

    def ready_gauge(self) -> float | None:
        """The scheduler's ``deferral_servers_available``, None if it does not answer."""
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        try:
            with urllib.request.urlopen(url, timeout=5) as reply:
                scrape = reply.read().decode()
        except OSError:
            return None
        for line in scrape.splitlines():
            name, _, value = line.partition(" ")
            if name == "deferral_servers_available":
                return float(value)
        return None

    def through(self, case: str, fault: Callable[[], None]) -> None:
        """Trigger a run of N deferring tasks; once they all deferred, ``fault`` (which returns
        once the server is back); then check the run."""
        self.dags.joinpath(f"{case}.py").write_text(outage_dag(case, N, self.out, seconds=3))
        assert self.services.run("dags", "trigger", case, "--run-id", "r").returncode == 0
        wait_for(
            # Half: the first resume while the last defer on a loaded machine.
            lambda: reached(self.sessions, "deferred", case) >= N // 2,
            timeout=120,
            what="half the tasks deferred",
        )
        fault()
        back = database_now(self.sessions)
        resumed = wait_for(
            lambda: first_change_after(self.sessions, case, back),
            timeout=120,
            what="work to resume",
        )
        assert (resumed - back).total_seconds() < RESUME_DEADLINE_SEC
        wait_for(
            lambda: run_finished(self.sessions, case, "r"), timeout=180, what="the run to finish"
        )
        assert problems(self.sessions, case, "r", N, self.out) == []
        dead = {name: p.poll() for name, p in self.services.procs.items() if p.poll() is not None}
        assert dead == {}


@pytest.fixture(scope="module")
def faulted(fernet_key: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Faulted]:
    home = tmp_path_factory.mktemp("pgfaults")
    for folder in ("dags", "logs", "out"):
        (home / folder).mkdir()
    for cluster in running(LocalPostgres(replica=True)):
        admin = create_engine(cluster.admin_url(), isolation_level="AUTOCOMMIT")
        with admin.connect() as conn:
            conn.execute(text("CREATE DATABASE deferral"))
        admin.dispose()
        url = make_url(cluster.failover_url).set(database="deferral").render_as_string(False)
        migrate.upgrade(url)
        (metrics_port,) = free_ports(1)
        prefix = new_stream_prefix()
        env = {
            "DEFERRAL_DATABASE_URL": url,
            "DEFERRAL_REDIS_URL": REDIS_URL,
            "DEFERRAL_FERNET_KEY": fernet_key,
            "DEFERRAL_DAGS_FOLDER": str(home / "dags"),
            "DEFERRAL_STREAM_PREFIX": prefix,
            "DEFERRAL_HEARTBEAT_SEC": "1",
        }
        services = Services(env, home / "logs")
        engine = make_engine(url, pool_size=2, pool_pre_ping=True)
        try:
            services.start("scheduler", "--metrics-port", str(metrics_port))
            services.start("worker", "--concurrency", "4")
            services.start("triggerer")
            for name in ("scheduler", "worker", "triggerer"):
                services.wait_up(name)
            yield Faulted(
                cluster,
                services,
                make_sessionmaker(engine),
                home / "out",
                home / "dags",
                metrics_port,
            )
        finally:
            services.stop_all()
            engine.dispose()
            delete_stream_keys(REDIS_URL, prefix)


@pytest.fixture
def stack(faulted: Faulted, request: pytest.FixtureRequest) -> Iterator[Faulted]:
    yield faulted
    _show_logs_if_failed(request, faulted.services)


def test_an_immediate_shutdown_and_restart(stack: Faulted) -> None:
    port = stack.cluster.primary_port

    def restart() -> None:
        stack.cluster.stop_server(port, "immediate")
        stack.cluster.start_server(port)

    stack.through("pg_restart", restart)


def test_an_outage_is_not_ready_logged_once_and_resumed(stack: Faulted) -> None:
    port = stack.cluster.primary_port
    names = ("scheduler", "worker", "triggerer")
    said_before = {name: stack.services.log(name).count("servers unavailable") for name in names}

    def outage() -> None:
        stack.cluster.stop_server(port, "immediate")
        began = dt.datetime.now(dt.UTC)
        wait_for(lambda: stack.ready_gauge() == 0, timeout=60, what="the scheduler not ready")
        wait_for(
            lambda: dt.datetime.now(dt.UTC) - began >= dt.timedelta(seconds=OUTAGE_SEC),
            timeout=60,
            interval=0.2,
        )
        stack.cluster.start_server(port)

    stack.through("pg_outage", outage)
    wait_for(lambda: stack.ready_gauge() == 1, timeout=60, what="the scheduler ready again")
    for name in names:
        log = stack.services.log(name)
        # At most one line for the outage (said once a minute), not one per attempt; none if
        # it began while the restart's was still settling.
        assert log.count("servers unavailable") - said_before[name] <= 1, name
        assert "failed: (psycopg" not in log, name


def test_a_failover_to_the_promoted_replica(stack: Faulted) -> None:
    def failover() -> None:
        stack.cluster.stop_server(stack.cluster.primary_port, "immediate")
        stack.cluster.promote()

    stack.through("pg_failover", failover)
    with stack.sessions() as session:
        port = session.scalar(text("SELECT inet_server_port()"))
    assert port == stack.cluster.replica_port
