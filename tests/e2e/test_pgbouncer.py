"""Every service and the CLI through Debian's PgBouncer in transaction pooling mode
(``DEFERRAL_DATABASE_POOLING=transaction``): consecutive transactions of one client reach
different server connections, so nothing may live in a server session (no prepared statements,
no session settings). A run defers, resumes and finishes through it; the CLI reads through it."""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from sqlalchemy import Engine, text
from sqlalchemy.engine import make_url
from sqlalchemy.exc import DBAPIError

from deferral.store.db import make_engine
from deferral_cli.embedded import free_port
from tests.e2e.conftest import Services
from tests.helpers import wait_for
from tests.servers import ADMIN_URL

pytestmark = pytest.mark.e2e

PGBOUNCER = Path("/usr/sbin/pgbouncer")
# PgBouncer refuses to run as root; it drops to this user (Debian's PostgreSQL packages make it).
RUN_AS = "postgres"

DAG = """
import datetime as dt

from deferral import DAG
from deferral.operators import PythonOperator
from deferral.sensors import TimeDeltaSensorAsync

with DAG("e2e_pgbouncer") as dag:
    waits = [
        TimeDeltaSensorAsync(task_id=f"wait_{n}", delta=dt.timedelta(seconds=2)) for n in range(8)
    ]
    waits >> PythonOperator(task_id="after", python_callable=lambda: "through pgbouncer")
"""


@pytest.fixture
def pgbouncer() -> Iterator[int]:
    """A PgBouncer in transaction mode before the test PostgreSQL; its port."""
    if not PGBOUNCER.exists():
        pytest.fail(f"{PGBOUNCER} missing: apt-get install -y pgbouncer")
    server = make_url(ADMIN_URL)
    port = free_port()
    # Its own folder, readable and writable by the user it drops to.
    folder = Path(tempfile.mkdtemp(prefix="deferral-pgbouncer-"))
    shutil.chown(folder, RUN_AS)
    login = f"user={server.username}" + (f" password={server.password}" if server.password else "")
    (folder / "users.txt").write_text(f'"{server.username}" ""\n')
    (folder / "pgbouncer.ini").write_text(
        f"""[databases]
* = host={server.host} port={server.port or 5432} {login}
[pgbouncer]
listen_addr = 127.0.0.1
listen_port = {port}
unix_socket_dir =
auth_type = trust
auth_file = {folder / "users.txt"}
admin_users = {server.username}
pool_mode = transaction
max_client_conn = 500
default_pool_size = 20
logfile = {folder / "pgbouncer.log"}
"""
    )
    for path in folder.iterdir():
        path.chmod(0o644)
    proc = subprocess.Popen(
        [str(PGBOUNCER), "-u", RUN_AS, str(folder / "pgbouncer.ini")],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_for(lambda: _answers(port), timeout=30, what="pgbouncer to listen")
        yield port
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        shutil.rmtree(folder, ignore_errors=True)


def _answers(port: int) -> bool:
    try:
        _transactions(port, "pgbouncer")
    except psycopg.OperationalError:
        return False
    return True


def _transactions(port: int, database: str) -> int:
    """Transactions PgBouncer has passed on to ``database`` (its admin console's SHOW STATS)."""
    user = make_url(ADMIN_URL).username
    with psycopg.connect(
        f"host=127.0.0.1 port={port} dbname=pgbouncer user={user}",
        autocommit=True,
        cursor_factory=psycopg.ClientCursor,  # the console speaks the simple protocol only
    ) as conn:
        rows = conn.execute("SHOW STATS").fetchall()
        names = [column.name for column in conn.execute("SHOW STATS").description or []]
    counts = {row[names.index("database")]: row[names.index("total_xact_count")] for row in rows}
    return int(counts.get(database, 0))


def test_a_run_defers_resumes_and_finishes_through_pgbouncer_in_transaction_mode(
    pgbouncer: int, services: Services, write_dag: object, database_url: str
) -> None:
    direct = make_url(database_url)
    through = direct.set(host="127.0.0.1", port=pgbouncer)
    services.env["DEFERRAL_DATABASE_URL"] = through.render_as_string(hide_password=False)
    services.env["DEFERRAL_DATABASE_POOLING"] = "transaction"
    write_dag("e2e_pgbouncer_dag", DAG)  # type: ignore[operator]
    for name in ("scheduler", "triggerer", "worker"):
        services.start(name)

    done = services.run(
        "dags", "trigger", "e2e_pgbouncer", "--wait", "--timeout", "150", timeout=240
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.splitlines()[-1].endswith(": success")

    # The CLI reads through it as well, every statement many times over (past psycopg's
    # threshold for preparing a statement on the server).
    for args in (
        ("runs", "list", "e2e_pgbouncer"),
        ("tasks", "explain", "e2e_pgbouncer", "latest", "after"),
        ("xcom", "list", "e2e_pgbouncer", "latest"),
        ("triggerers", "list"),
        ("db", "prune", "--older-than", "1d"),  # the history's partitions, row paths and all
        ("health", "--service", "scheduler", "--name", _name_of(services, "scheduler")),
    ):
        answered = services.run(*args)
        assert answered.returncode == 0, (args, answered.stdout + answered.stderr)
    assert "through pgbouncer" in services.run("xcom", "list", "e2e_pgbouncer", "latest").stdout
    for name in ("scheduler", "triggerer", "worker"):
        log = services.log(name)
        assert "prepared statement" not in log and "Traceback" not in log, log[-2000:]
    # It all went through PgBouncer.
    assert _transactions(pgbouncer, direct.database or "") > 100


def _name_of(services: Services, service: str) -> str:
    """The name a service registered under (the host and its pid, by default)."""
    proc = services.procs[service]
    return f"{socket.gethostname()}-{proc.pid}"


def test_server_side_prepared_statements_break_through_it_unless_pooling_says_transaction(
    pgbouncer: int, database_url: str
) -> None:
    url = make_url(database_url).set(host="127.0.0.1", port=pgbouncer)
    failures = {}
    for pooling in ("session", "transaction"):
        engine = make_engine(url.render_as_string(hide_password=False), pooling=pooling)
        errors: list[str] = []

        def work(engine: Engine = engine, errors: list[str] = errors) -> None:
            for n in range(30):  # past psycopg's fifth run, after which it prepares
                try:
                    with engine.begin() as conn:
                        conn.execute(
                            text("SELECT count(*) FROM dag WHERE dag_id = :d"), {"d": str(n)}
                        )
                except DBAPIError as exc:
                    errors.append(type(exc.orig).__name__)

        threads = [threading.Thread(target=work) for _ in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        engine.dispose()
        failures[pooling] = errors
    assert failures["session"], "expected prepared statements to clash through PgBouncer"
    assert failures["transaction"] == []
