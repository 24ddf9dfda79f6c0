"""Real service processes (``scheduler consume``, ``worker consume``, ``triggerer consume``) run
as their console scripts against the test database and Redis prefix, each forked from a process
of the lane's that has imported them (``tests/forks.py``).

``services`` gives each test processes of its own. A module of happy-path tests (none kills,
stops or reconfigures a service) can share one stack instead: its ``module_stack`` fixture starts
the processes once (``shared_stack_fixtures``), and ``services``, ``sessions`` and ``write_dag``
are the module's. Its tests run in one xdist lane, in file order (``--dist loadscope``), on a
database emptied once for the module, so each test keeps to its own DAG ids."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from broker.client import Broker
from deferral.runtime.config import load_settings
from deferral.runtime.crypto import Cipher, Purpose
from deferral.states import TaskState
from deferral.store.db import make_engine, make_sessionmaker
from deferral.store.tables import SerializedDag, TaskInstance, Trigger
from tests.conftest import delete_stream_keys, empty_tables, new_stream_prefix
from tests.forks import LANE, ForkedProcess
from tests.helpers import wait_for
from tests.parsed_dags import record_dags_folder
from tests.servers import TEST_FAR_TIMER_HORIZON_SEC
from triggerer.events import event_message

BIN = Path(sys.executable).parent
# A worker starts and warms one task process per slot before it takes work (16 by default):
# seconds of CPU per start on a loaded machine. Tests get two unless they ask for more.
TEST_WORKER_CONCURRENCY = "2"


# The services and CLI commands of this lane's tests.
CLI = LANE


@pytest.fixture(scope="session", autouse=True)
def _forks() -> None:
    CLI.start()  # its imports overlap the first test's own start


def command(name: str, *args: str) -> list[str]:
    """The console script ``name`` next to this interpreter, else ``python -m name``."""
    script = BIN / name
    return [str(script), *args] if script.exists() else [sys.executable, "-m", name, *args]


# The commands that act on a DAG's parsed document (readmodel/DECISIONS.md 5), its id next.
READS_THE_DOCUMENT = {
    ("dags", name) for name in ("trigger", "pause", "unpause", "backfill", "next-run")
} | {("tasks", "clear"), ("tasks", "mark")}


class Services:
    def __init__(self, env: dict[str, str], logs: Path) -> None:
        self.env = {**os.environ, **env, "PYTHONUNBUFFERED": "1"}
        self.logs = logs
        self.procs: dict[str, subprocess.Popen[bytes] | ForkedProcess] = {}

    def start(self, name: str, *args: str, env: dict[str, str] | None = None) -> ForkedProcess:
        """Start ``<service> consume [args]``; ``name`` is unique per process (worker2, ...);
        ``env`` adds to the environment of this process only. A name started again appends to
        its log. A worker started without ``--concurrency`` gets TEST_WORKER_CONCURRENCY."""
        service = name.rstrip("0123456789")
        if service == "worker" and not any(a.startswith("--concurrency") for a in args):
            args = ("--concurrency", TEST_WORKER_CONCURRENCY, *args)
        proc = CLI.spawn(
            service,
            ["consume", *args],
            {**self.env, **(env or {})},
            None,
            self.logs / f"{name}.log",
        )
        self.procs[name] = proc
        return proc

    def spawn(
        self, name: str, argv: list[str], env: dict[str, str], cwd: Path | None = None
    ) -> subprocess.Popen[bytes]:
        """Start ``argv`` with exactly ``env``, logging to ``<name>.log``; stopped at teardown."""
        log = (self.logs / f"{name}.log").open("ab")
        proc = subprocess.Popen(argv, env=env, cwd=cwd, stdout=log, stderr=subprocess.STDOUT)
        self.procs[name] = proc
        return proc

    def run(
        self, *args: str, timeout: float = 180, env: dict[str, str] | None = None
    ) -> subprocess.CompletedProcess[str]:
        """Run a ``deferral`` CLI command to completion, in a process of its own forked from
        one with the CLI imported (``tests/forks.py``); ``env`` adds to its environment.
        (The timeout is slack for a loaded machine.)"""
        if args[:2] in READS_THE_DOCUMENT and len(args) > 2:
            self.parsed(args[2], env)
        return CLI.run(list(args), {**self.env, **(env or {})}, timeout)

    def parsed(self, dag_id: str, env: dict[str, str] | None = None) -> None:
        """A trigger (and the other READS_THE_DOCUMENT) reads the DAG's document a scheduler
        writes (readmodel/DECISIONS.md 5): one not written yet (no scheduler running, or its
        first parse not done) is recorded here, as a scheduler's parse does."""
        given = {**self.env, **(env or {})}
        settings = load_settings(given)
        pooling = given.get(
            "DEFERRAL_DATABASE_POOLING"
        )  # through PgBouncer: tests/e2e/test_pgbouncer.py
        engine = make_engine(settings.database_url, pooling=pooling)

        def found() -> bool:
            # A running scheduler's parse begun before the file was written may remove the
            # document recorded here: recorded again until it stays.
            with make_sessionmaker(engine)() as session:
                if session.get(SerializedDag, dag_id) is not None:
                    return True
            record_dags_folder(settings, pooling)
            return False

        try:
            wait_for(found, timeout=60, what=f"DAG {dag_id!r} parsed")
        finally:
            engine.dispose()

    def log(self, name: str) -> str:
        return (self.logs / f"{name}.log").read_text(errors="replace")

    def starts(self, name: str) -> int:
        """How many times the process ``name`` (its log, appended to by each start) said it
        was up: a scheduler once started, a worker or triggerer once consuming (a worker's task
        processes are up by then)."""
        service = name.rstrip("0123456789")
        said = re.compile(rf"\b{service} \S+ (started|consuming)\b")
        path = self.logs / f"{name}.log"
        return len(said.findall(self.log(name))) if path.exists() else 0

    def wait_up(self, name: str, starts_before: int = 0) -> None:
        """Wait until the process ``name`` said it was up since ``starts_before`` starts."""
        wait_for(lambda: self.starts(name) > starts_before, timeout=180, what=f"{name} to be up")

    def stop_all(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGCONT)  # a stopped process cannot handle SIGTERM
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs.values():
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@pytest.fixture
def services(
    service_env: dict[str, str],
    tmp_path: Path,
    request: pytest.FixtureRequest,
    broker: Broker,  # torn down after the services stop, so keys outlive the processes
) -> Iterator[Services]:
    logs = tmp_path / "logs"
    logs.mkdir()
    running = Services(service_env, logs)
    yield running
    running.stop_all()
    _show_logs_if_failed(request, running)


def _show_logs_if_failed(request: pytest.FixtureRequest, running: Services) -> None:
    report = getattr(request.node, "rep_call", None)
    if report is not None and report.failed:
        for name in running.procs:
            sys.stderr.write(f"\n----- {name} log -----\n{running.log(name)[-6000:]}\n")


def fire_deferred(
    sessions: sessionmaker[Session], broker: Broker, cipher: Cipher, dag_id: str, task_id: str
) -> None:
    """Publish the event the trigger of the deferred ``task_id`` (a DateTimeTrigger or one of
    its kind) will fire, as its triggerer would when its moment comes: a test that has seen the
    deferral ends it then, rather than race a moment against a loaded machine. (The triggerer's
    own copy, later, is a duplicate.)"""
    with sessions() as session:
        trigger_id = session.scalars(
            select(TaskInstance.trigger_id)
            .where(
                TaskInstance.dag_id == dag_id,
                TaskInstance.task_id == task_id,
                TaskInstance.state == TaskState.DEFERRED,
            )
            .order_by(TaskInstance.id.desc())
        ).first()
        assert trigger_id is not None, f"{dag_id}.{task_id} is not deferred"
        trigger = session.get(Trigger, trigger_id)
        assert trigger is not None
        moment = cipher.open(Purpose.TRIGGER_KWARGS, trigger.kwargs)["moment"]
    broker.publish(broker.keys.events, event_message(cipher, trigger_id, moment, "test"))


@dataclass
class Stack:
    """Service processes shared by the tests of a module, with their DAGs folder and database."""

    services: Services
    sessions: sessionmaker[Session]
    dags_folder: Path
    broker: Broker


@pytest.fixture(scope="module")
def module_stack(
    database_url: str, fernet_key: str, redis_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Stack]:
    """An environment for one module's processes (a stream prefix and DAGs folder of its own, the
    session's database emptied once, the module's ``redis_url``); the module starts what it
    needs. Stopped, and its keys deleted, after the module's last test."""
    engine = make_engine(database_url)
    empty_tables(engine)
    home = tmp_path_factory.mktemp("stack")
    dags = home / "dags"
    dags.mkdir()
    logs = home / "logs"
    logs.mkdir()
    prefix = new_stream_prefix()
    env = {
        "DEFERRAL_DATABASE_URL": database_url,
        "DEFERRAL_REDIS_URL": redis_url,
        "DEFERRAL_FERNET_KEY": fernet_key,
        "DEFERRAL_DAGS_FOLDER": str(dags),
        "DEFERRAL_STREAM_PREFIX": prefix,
        "DEFERRAL_HEARTBEAT_SEC": "1",
        # A test deferring an hour ahead means a trigger held by a triggerer: far timers
        # (deferral.store.far_timers) are tested with a horizon of their own.
        "DEFERRAL_FAR_TIMER_HORIZON_SEC": TEST_FAR_TIMER_HORIZON_SEC,
    }
    running = Services(env, logs)
    broker = Broker.from_url(redis_url, prefix)
    try:
        yield Stack(running, make_sessionmaker(engine), dags, broker)
    finally:
        running.stop_all()
        broker.close()
        delete_stream_keys(redis_url, prefix)
        engine.dispose()


def shared_stack_fixtures(*processes: tuple[str, ...]) -> tuple[Any, Any, Any, Any]:
    """The fixtures of a module whose tests share one stack of ``processes`` (each a name and
    its arguments, as for ``Services.start``), to assign at module level::

        stack, services, sessions, write_dag = shared_stack_fixtures(("scheduler",), ...)
    """

    @pytest.fixture(scope="module", name="stack")
    def stack_fixture(module_stack: Stack) -> Stack:
        for name, *args in processes:
            module_stack.services.start(name, *args)
        for name, *_ in processes:  # up before the first test's clock starts
            module_stack.services.wait_up(name)
        return module_stack

    @pytest.fixture(name="services")
    def services_fixture(stack: Stack, request: pytest.FixtureRequest) -> Iterator[Services]:
        """The module's processes (a test's failure shows their logs)."""
        yield stack.services
        _show_logs_if_failed(request, stack.services)

    @pytest.fixture(name="sessions")
    def sessions_fixture(stack: Stack) -> sessionmaker[Session]:
        """A sessionmaker on the module's database, not emptied between its tests."""
        return stack.sessions

    @pytest.fixture(name="write_dag")
    def write_dag_fixture(stack: Stack) -> Callable[[str, str], Path]:
        """Write a DAG file into the module's DAGs folder."""

        def write(name: str, source: str) -> Path:
            path = stack.dags_folder / f"{name}.py"
            path.write_text(source)
            return path

        return write

    return stack_fixture, services_fixture, sessions_fixture, write_dag_fixture


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> object:
    report = yield
    setattr(item, f"rep_{report.when}", report)
    return report
