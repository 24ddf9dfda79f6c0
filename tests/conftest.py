"""Shared fixtures. Integration and end-to-end tests use real PostgreSQL and Redis (which ones:
tests/servers.py): the session creates, migrates and finally drops its own database (one per
pytest-xdist lane: each lane is a session); each test gets its own stream prefix, and its keys are
deleted afterwards. Every prefix of a run starts with ``deferral_test_<run>_`` (one ``<run>`` for
all lanes), and the run fails at its end if any key under those prefixes is left in Redis.

With ``-n 2`` each module runs whole in one lane (``--dist loadscope`` in pyproject.toml), so the
tests of a module may share a module-scoped fixture, such as a service stack started once.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import hashlib
import os
import re
import sys
import threading
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from cryptography.fernet import Fernet
from sqlalchemy import create_engine, text
from sqlalchemy.engine import Connection, Engine, make_url
from sqlalchemy.orm import Session, sessionmaker

from broker import topology
from broker.client import Broker
from deferral.runtime.config import Settings, load_settings
from deferral.runtime.crypto import Cipher
from deferral.store import migrate
from deferral.store.db import make_engine, make_sessionmaker
from tests.forks import LANE
from tests.helpers import wait_for
from tests.servers import ADMIN_URL, REDIS_URL, TEST_FAR_TIMER_HORIZON_SEC

# Tables cleared before each database test; pool keeps its seeded default_pool row.
TABLES = (
    "task_state_change, xcom, task_reschedule, resume_event, outbox, dag, import_error, worker, "
    "serialized_dag, dag_folder_parse, "
    "signal_wait, wait_timer, signal, signal_count, idempotency_key, "
    "task_log, task_log_try, api_token, "
    "rendered_task_instance_fields, variable, connection, "
    "hitl_detail, deadline_miss, "
    'task_instance, trigger, triggerer, scheduler, dag_run, dag_run_count, "user", web_session, '
    "asset, asset_event, dag_schedule_asset, task_outlet_asset, asset_dag_run_queue, "
    "dag_run_asset_event, asset_watcher, asset_alias_asset, asset_alias_event, task_state, "
    "asset_state"
)

__all__ = ["new_stream_prefix", "wait_for"]

# One id for the whole run, shared by its xdist lanes (they inherit the controller's environment,
# which imports this module first), so that the end-of-run check sees only this run's keys and
# not those of other runs on the same Redis.
RUN_ID = os.environ.setdefault("DEFERRAL_TEST_RUN_ID", uuid.uuid4().hex[:6])
RUN_PREFIX = f"deferral_test_{RUN_ID}_"


def new_stream_prefix() -> str:
    """A stream prefix of this run's own; whoever takes one deletes its keys afterwards
    (``delete_stream_keys``), or the run fails at its end."""
    return f"{RUN_PREFIX}{uuid.uuid4().hex[:8]}"


def delete_stream_keys(redis_url: str, prefix: str) -> None:
    """Delete every key under ``prefix``."""
    client = topology.client(redis_url, {}, max_connections=4)  # a cluster: on every primary
    try:
        keys = list(client.scan_iter(match=f"{prefix}:*", count=1000))
        if keys:
            client.delete(*keys)
    finally:
        client.close()


# The threads dropping this process's databases (``drop_database_later``).
_DROPPING: list[threading.Thread] = []


def drop_database_later(name: str) -> None:
    """Drop database ``name`` (and end its connections) in a thread of its own, which the
    session waits for at its end: dropping a database unlinks every file of its tables,
    partitions and indexes, seconds on a busy disk that the next test need not wait."""

    def drop() -> None:
        admin = create_engine(ADMIN_URL, isolation_level="AUTOCOMMIT")
        try:
            with admin.connect() as conn:
                conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        finally:
            admin.dispose()

    thread = threading.Thread(target=drop, name=f"drop {name}")
    thread.start()
    _DROPPING.append(thread)


def wait_for_drops() -> None:
    """Return once every database ``drop_database_later`` was given is dropped."""
    while _DROPPING:
        _DROPPING.pop().join()


@pytest.fixture(scope="session", autouse=True)
def _databases_dropped() -> Iterator[None]:
    """The databases dropped meanwhile are gone when the session ends."""
    yield
    wait_for_drops()


@pytest.fixture(scope="session", autouse=True)
def _stop_the_lanes_forks() -> Iterator[None]:
    """The lane's forking process (tests/forks.py), started by its first use, stops at the
    session's end."""
    yield
    LANE.close()


@pytest.fixture(scope="session")
def database_url() -> Iterator[str]:
    """A fresh database for this test session, migrated to head."""
    yield from fresh_database("deferral_test")


def fresh_database(prefix: str) -> Iterator[str]:
    """The URL of a new database (named ``prefix`` and a random suffix: one per process, so one
    per xdist lane) at the migrations' head, dropped when the generator is closed. It is copied
    from a template migrated once per set of migrations (see :func:`_migrated_template`):
    running every migration took several seconds per database, a copy takes a fraction."""
    name = f"{prefix}_{uuid.uuid4().hex[:10]}"
    admin = create_engine(ADMIN_URL, isolation_level="AUTOCOMMIT")
    try:
        template = _migrated_template(admin)
        with admin.connect() as conn, _templates_locked(conn):
            conn.execute(text(f'CREATE DATABASE "{name}" TEMPLATE "{template}"'))
        # A commit of the tests' database does not wait for its WAL to reach the disk: no test
        # stops PostgreSQL, so what a commit made is as visible and as kept for them, and the
        # suite's thousands of commits stop queueing on the disk of a shared machine.
        with admin.connect() as conn:
            conn.execute(text(f'ALTER DATABASE "{name}" SET synchronous_commit TO off'))
        yield make_url(ADMIN_URL).set(database=name).render_as_string(hide_password=False)
    finally:  # closing the generator at its yield must drop the database too
        admin.dispose()
        drop_database_later(name)


_TEMPLATE_PREFIX = "deferral_template_"
_MIGRATIONS = Path(__file__).resolve().parent.parent / "migrations"


@contextlib.contextmanager
def _templates_locked(conn: Connection) -> Iterator[None]:
    """One process at a time builds, copies or drops templates (a template being copied must
    have no other connection, and two lanes must not build the same one)."""
    conn.execute(text("SELECT pg_advisory_lock(hashtext('deferral_test_templates'))"))
    try:
        yield
    finally:
        conn.execute(text("SELECT pg_advisory_unlock(hashtext('deferral_test_templates'))"))


def _migrated_template(admin: Engine) -> str:
    """The name of a database migrated to head by this checkout's migrations, today (a
    migration may create date-dependent partitions): built under a temporary name and renamed
    when complete, so a build that dies leaves no template. Templates of earlier days are
    dropped; today's of other checkouts (other migrations) are left to them."""
    today = dt.date.today()
    digest = hashlib.sha256()
    for path in sorted(_MIGRATIONS.rglob("*.py")):
        digest.update(path.relative_to(_MIGRATIONS).as_posix().encode() + path.read_bytes())
    dated = f"{_TEMPLATE_PREFIX}{today:%Y%m%d}_"
    template = f"{dated}{digest.hexdigest()[:16]}"
    with admin.connect() as conn, _templates_locked(conn):
        existing = set(
            conn.scalars(
                text("SELECT datname FROM pg_database WHERE datname LIKE :like"),
                {"like": f"{_TEMPLATE_PREFIX}%"},
            )
        )
        earlier = [
            name
            for name in existing
            if re.fullmatch(rf"{_TEMPLATE_PREFIX}(\d{{8}})_[0-9a-f]{{16}}(_[0-9a-f]{{6}})?", name)
            and name[len(_TEMPLATE_PREFIX) : len(_TEMPLATE_PREFIX) + 8] < f"{today:%Y%m%d}"
        ]
        for stale in earlier:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{stale}" WITH (FORCE)'))
        if template not in existing:
            building = f"{template}_{uuid.uuid4().hex[:6]}"[:63]
            conn.execute(text(f'CREATE DATABASE "{building}"'))
            migrate.upgrade(make_url(ADMIN_URL).set(database=building).render_as_string(False))
            # Alembic's connections may linger in the pool of its engine: none may stay.
            conn.execute(
                text(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                    " WHERE datname = :name AND pid <> pg_backend_pid()"
                ),
                {"name": building},
            )
            conn.execute(text(f'ALTER DATABASE "{building}" RENAME TO "{template}"'))
    return template


# Of TABLES, those holding a row or whose id sequence has been used (a rolled-back insert
# leaves the table empty and the sequence on): the ones to empty.
_USED = " UNION ALL ".join(
    f"SELECT '{table}' WHERE EXISTS (SELECT FROM {table})" for table in TABLES.split(", ")
) + (
    " UNION ALL SELECT quote_ident(t.relname) FROM pg_sequences s"
    " JOIN pg_class q ON q.relname = s.sequencename AND q.relkind = 'S'"
    " JOIN pg_depend d ON d.objid = q.oid AND d.deptype IN ('a', 'i')"
    " JOIN pg_class t ON t.oid = d.refobjid"
    " WHERE s.schemaname = current_schema() AND s.last_value IS NOT NULL"
)


def empty_tables(engine: Engine) -> None:
    """Empty TABLES and restart their ids, as ``TRUNCATE TABLES RESTART IDENTITY CASCADE``
    does, truncating only the tables a test used (a truncate costs per table: all twenty took
    about 0.3 s before every database test)."""
    listed = set(TABLES.split(", "))
    with engine.begin() as conn:
        used = sorted({name for (name,) in conn.execute(text(_USED))} & listed)
        if used:
            conn.execute(text(f"TRUNCATE {', '.join(used)} RESTART IDENTITY CASCADE"))


@pytest.fixture
def sessions(database_url: str) -> Iterator[sessionmaker[Session]]:
    """A sessionmaker on the test database, emptied before the test."""
    engine = make_engine(database_url)
    empty_tables(engine)
    yield make_sessionmaker(engine)
    engine.dispose()


@pytest.fixture(scope="session")
def fernet_key() -> str:
    return Fernet.generate_key().decode()


@pytest.fixture
def cipher(fernet_key: str) -> Cipher:
    return Cipher([fernet_key])


@pytest.fixture(scope="session")
def redis_url() -> str:
    """The Redis the tests' brokers and services use; a module overrides it to run its tests
    on another topology (tests/e2e/test_redis_cluster.py: a Redis Cluster)."""
    return REDIS_URL


@pytest.fixture
def stream_prefix(redis_url: str) -> Iterator[str]:
    """The test's own stream prefix; every key under it is deleted afterwards (after the
    services and brokers of the test have stopped: they all depend on this fixture)."""
    prefix = new_stream_prefix()
    yield prefix
    delete_stream_keys(redis_url, prefix)


@pytest.fixture
def broker(stream_prefix: str, redis_url: str) -> Iterator[Broker]:
    """A broker on the test's prefix (whose keys ``stream_prefix`` deletes afterwards)."""
    broker = Broker.from_url(redis_url, stream_prefix)
    yield broker
    broker.close()


@pytest.fixture
def dags_folder(tmp_path: Path) -> Path:
    folder = tmp_path / "dags"
    folder.mkdir()
    return folder


@pytest.fixture
def service_env(
    database_url: str, fernet_key: str, stream_prefix: str, dags_folder: Path, redis_url: str
) -> dict[str, str]:
    """DEFERRAL_* variables pointing at the test database, Redis prefix and DAGs folder."""
    return {
        "DEFERRAL_DATABASE_URL": database_url,
        "DEFERRAL_REDIS_URL": redis_url,
        "DEFERRAL_FERNET_KEY": fernet_key,
        "DEFERRAL_DAGS_FOLDER": str(dags_folder),
        "DEFERRAL_STREAM_PREFIX": stream_prefix,
        "DEFERRAL_HEARTBEAT_SEC": "1",
        # A test deferring an hour ahead means a trigger held by a triggerer: far timers
        # (deferral.store.far_timers) are tested with a horizon of their own.
        "DEFERRAL_FAR_TIMER_HORIZON_SEC": TEST_FAR_TIMER_HORIZON_SEC,
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
    return (
        f"deferral test servers: postgres {make_url(ADMIN_URL)!r}, redis {REDIS_URL}; "
        f"stream prefixes {RUN_PREFIX}*"
    )


# The end-to-end modules that take longest (by --durations of full runs), slowest first, started
# first so that no long one ends the run alone (``--no-loadscope-reorder`` in pyproject.toml
# keeps the order made here). An end-to-end module missing here comes after these, in file order.
SLOWEST_FIRST = (
    "tests/e2e/test_redis_cluster.py",
    "tests/e2e/test_hostile_entries.py",
    "tests/e2e/test_compose_stack.py",
    "tests/e2e/test_standalone.py",
    "tests/e2e/test_dead_letters.py",
    "tests/e2e/test_triggerer_isolation.py",
    "tests/e2e/test_core_faults.py",
    "tests/e2e/test_webui_browser.py",
    "tests/e2e/test_triggerer_leases.py",
    "tests/e2e/test_secrets_masked.py",
    "tests/e2e/test_user_actions.py",
    "tests/e2e/test_task_logs.py",
    "tests/e2e/test_key_rotation.py",
    "tests/e2e/test_metrics.py",
    "tests/e2e/test_redis_loss.py",
    "tests/e2e/test_schedules.py",
    "tests/e2e/test_redis_wipe_under_churn.py",
    "tests/e2e/test_custom_trigger.py",
    "tests/e2e/test_templating.py",
    "tests/e2e/test_dag_files.py",
)


def module_order(modules: list[str]) -> list[str]:
    """The order in which the lanes take ``modules``: end-to-end modules (mostly waiting on
    services: about 0.65 of a core each) interleaved with the integration and unit ones (a core
    each), each kind spread evenly over the run, so that a lane's wait is another lane's CPU
    time instead of both lanes waiting at the start and both computing at the end."""
    rank = {path: i for i, path in enumerate(SLOWEST_FIRST)}
    e2e = sorted(
        (m for m in modules if m.startswith("tests/e2e/")), key=lambda m: rank.get(m, len(rank))
    )
    rest = [m for m in modules if not m.startswith("tests/e2e/")]
    place = {m: i / max(len(e2e), 1) for i, m in enumerate(e2e)}
    place.update({m: (i + 0.5) / max(len(rest), 1) for i, m in enumerate(rest)})
    return sorted(modules, key=lambda m: place[m])


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Order the modules (``module_order``), each module's tests still together and in file
    order."""
    modules = list(dict.fromkeys(item.nodeid.split("::", 1)[0] for item in items))
    index = {m: i for i, m in enumerate(module_order(modules))}
    items.sort(key=lambda item: index[item.nodeid.split("::", 1)[0]])


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """At the end of the run (in the xdist controller, or the only process), fail if any key
    of this run's stream prefixes is left in Redis, naming them; then delete them."""
    if hasattr(session.config, "workerinput"):  # an xdist lane: the controller checks
        return
    client = redis.Redis.from_url(REDIS_URL)
    try:
        left = sorted(k.decode() for k in client.scan_iter(match=f"{RUN_PREFIX}*", count=1000))
        if left:
            client.delete(*left)
    finally:
        client.close()
    if not left:
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    message = (
        f"{len(left)} Redis key(s) of this run's stream prefixes were left behind "
        f"(a test that takes a prefix must delete its keys): {', '.join(left[:20])}"
    )
    if reporter is not None:
        reporter.write_line(f"ERROR: {message}", red=True)
    else:
        sys.stderr.write(f"ERROR: {message}\n")
    session.exitstatus = pytest.ExitCode.TESTS_FAILED
