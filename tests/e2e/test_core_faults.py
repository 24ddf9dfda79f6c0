"""The core under faults, through the real processes: a scheduler killed after reading events,
transient database errors, a worker whose lease was taken over, an entry that kills its
consumer, Redis down at start, a DAG file that stops importing."""

from __future__ import annotations

import datetime as dt
import os
import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

from broker.client import Broker
from deferral.store.tables import DagRun, ResumeEvent, TaskInstance, TaskStateChange, XCom
from deferral_cli.embedded import redis_server_binary
from tests.e2e.conftest import Services
from tests.helpers import process_alive, wait_for

pytestmark = pytest.mark.e2e

MOMENT_DAG = """
import datetime as dt

from deferral import DAG, BaseOperator
from deferral.triggers import DateTimeTrigger

MOMENT = dt.datetime.fromisoformat("{moment}")


class Wait(BaseOperator):
    def execute(self, context):
        self.defer(trigger=DateTimeTrigger(MOMENT), method_name="resume")

    def resume(self, context, event):
        return "resumed"


with DAG("{dag_id}", max_active_tasks={n}) as dag:
    for i in range({n}):
        Wait(task_id=f"t{{i}}")
"""


GATE_DAG = """
from deferral import DAG, BaseOperator
from deferral.triggers import FileTrigger


class Wait(BaseOperator):
    def execute(self, context):
        self.defer(trigger=FileTrigger({gate!r}, poll_interval=0.5), method_name="resume")

    def resume(self, context, event):
        return "resumed"


with DAG("{dag_id}", max_active_tasks={n}) as dag:
    for i in range({n}):
        Wait(task_id=f"t{{i}}")
"""


def _moment_dag(write_dag: Any, dag_id: str, n: int, seconds: float) -> None:
    moment = dt.datetime.now(dt.UTC) + dt.timedelta(seconds=seconds)
    write_dag(dag_id, MOMENT_DAG.format(moment=moment.isoformat(), dag_id=dag_id, n=n))


def _gate_dag(write_dag: Any, dag_id: str, n: int, gate: Path) -> None:
    """``n`` tasks that defer until the file ``gate`` exists: the test opens it when it is
    ready, rather than guessing a moment far enough ahead."""
    write_dag(dag_id, GATE_DAG.format(gate=str(gate), dag_id=dag_id, n=n))


def _states(sessions: sessionmaker[Session]) -> dict[str, str]:
    with sessions() as session:
        return dict(session.execute(select(TaskInstance.task_id, TaskInstance.state)).all())


def _all(sessions: sessionmaker[Session], state: str, n: int) -> bool:
    states = _states(sessions)
    return len(states) == n and set(states.values()) == {state}


def _run_state(sessions: sessionmaker[Session]) -> str | None:
    with sessions() as session:
        return session.scalar(select(DagRun.state))


def _changes(sessions: sessionmaker[Session], from_state: str, to_state: str) -> dict[str, int]:
    """task id -> how many times it moved from ``from_state`` to ``to_state``."""
    with sessions() as session:
        rows = session.execute(
            select(TaskInstance.task_id, func.count())
            .join(TaskStateChange, TaskStateChange.task_instance_id == TaskInstance.id)
            .where(TaskStateChange.from_state == from_state, TaskStateChange.to_state == to_state)
            .group_by(TaskInstance.task_id)
        ).all()
    return dict(rows)


def test_a_scheduler_killed_after_reading_events_leaves_them_to_another(
    services: Services,
    write_dag: Any,
    sessions: sessionmaker[Session],
    broker: Broker,
    tmp_path: Path,
) -> None:
    n = 20
    gate = tmp_path / "gate"
    _gate_dag(write_dag, "e2e_crash", n, gate)
    doomed = services.start(
        "scheduler", env={"DEFERRAL_TEST_FAULTS": "scheduler.events_read:crash"}
    )
    services.start("worker", "--concurrency", "2")
    services.start("triggerer")
    assert services.run("dags", "trigger", "e2e_crash").returncode == 0
    wait_for(lambda: _all(sessions, "deferred", n), timeout=120, what="every task deferred")
    gate.write_text("open")  # every trigger fires

    # The scheduler dies (kill -9) right after it reads the first batch of fired events.
    assert doomed.wait(timeout=60) == -signal.SIGKILL
    services.start("scheduler2")

    wait_for(lambda: _all(sessions, "success", n), timeout=90, what="every task to succeed")
    assert _changes(sessions, "deferred", "scheduled") == {f"t{i}": 1 for i in range(n)}
    with sessions() as session:
        applied = session.scalar(
            select(func.count()).select_from(ResumeEvent).where(ResumeEvent.outcome == "applied")
        )
    assert applied == n
    assert "took over" in services.log("scheduler2")
    # The last event (or a wake entry written after a commit) may still be on its way out.
    wait_for(
        lambda: broker.redis.xlen(broker.keys.events) == 0,
        timeout=30,
        what="the events stream to be emptied",
    )
    assert broker.redis.xlen(broker.keys.dead) == 0


def test_transient_database_errors_delay_a_resume_and_fail_nothing(
    services: Services,
    write_dag: Any,
    sessions: sessionmaker[Session],
    broker: Broker,
    tmp_path: Path,
) -> None:
    gate = tmp_path / "gate"
    _gate_dag(write_dag, "e2e_transient", 3, gate)
    services.start("scheduler", env={"DEFERRAL_TEST_FAULTS": "scheduler.apply_events:3"})
    services.start("worker", "--concurrency", "2")
    services.start("triggerer")
    assert services.run("dags", "trigger", "e2e_transient").returncode == 0
    wait_for(lambda: _all(sessions, "deferred", 3), timeout=120, what="every task deferred")
    gate.write_text("open")

    wait_for(lambda: _all(sessions, "success", 3), timeout=90, what="every task to succeed")
    log = services.log("scheduler")
    assert "servers unavailable (OperationalError" in log
    assert "injected at scheduler.apply_events" in log
    assert log.count("servers unavailable") == 1  # said once for the whole outage
    assert _changes(sessions, "deferred", "scheduled") == {"t0": 1, "t1": 1, "t2": 1}
    assert broker.redis.xlen(broker.keys.dead) == 0
    wait_for(lambda: _run_state(sessions) == "success", timeout=30, what="the run to succeed")


SLOW_DAG = """
import datetime as dt
import os
import pathlib
import time

from deferral import DAG, BaseOperator

OUT = pathlib.Path({out!r})


class SlowFirstTry(BaseOperator):
    def execute(self, context):
        try_number = context["ti"].try_number
        (OUT / f"try{{try_number}}.pid").write_text(str(os.getpid()))
        if try_number == 1:
            time.sleep(120)
        return f"try {{try_number}}"


with DAG("e2e_stopped") as dag:
    SlowFirstTry(task_id="slow", retries=1, retry_delay=dt.timedelta(0))
"""


def test_a_worker_whose_lease_was_taken_over_drops_its_outcome_and_its_child(
    services: Services,
    write_dag: Any,
    sessions: sessionmaker[Session],
    tmp_path: Path,
) -> None:
    out = tmp_path / "out"
    out.mkdir()
    write_dag("e2e_stopped_dag", SLOW_DAG.format(out=str(out)))
    services.start("scheduler")
    victim = services.start("worker", "--concurrency", "1", "--name", "victim")
    assert services.run("dags", "trigger", "e2e_stopped").returncode == 0
    first_pid = int(
        wait_for(lambda: (out / "try1.pid").exists() and (out / "try1.pid").read_text(), timeout=60)
    )

    # Stopped past 2.1 x heartbeat (1 s here): another worker takes the attempt over.
    victim.send_signal(signal.SIGSTOP)
    services.start("worker2", "--concurrency", "1", "--name", "survivor")
    wait_for(
        lambda: _states(sessions).get("slow") == "success", timeout=90, what="the retry to succeed"
    )
    victim.send_signal(signal.SIGCONT)

    # Back, the victim finds its lease gone: it kills the first try's process, records nothing.
    wait_for(
        lambda: not process_alive(first_pid),
        timeout=30,
        what="the first try's process to be killed",
    )
    wait_for(lambda: "lost the lease on" in services.log("worker"), timeout=30)
    assert victim.poll() is None
    assert _changes(sessions, "running", "success") == {"slow": 1}
    with sessions() as session:
        ti = session.scalars(select(TaskInstance)).one()
        assert (ti.state, ti.try_number, ti.worker) == ("success", 2, "survivor")
        value = session.scalar(select(XCom.value).where(XCom.task_instance_id == ti.id))
    assert value == "try 2"
    with sessions() as session:
        reasons = session.scalars(select(TaskStateChange.reason)).all()
    assert "worker victim stopped heartbeating" in reasons


def test_services_started_with_redis_down_wait_and_then_work(
    services: Services, write_dag: Any, sessions: sessionmaker[Session], tmp_path: Path
) -> None:
    binary = redis_server_binary()
    assert binary is not None
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    services.env["DEFERRAL_REDIS_URL"] = f"redis://127.0.0.1:{port}/0"
    _moment_dag(write_dag, "e2e_late_redis", 2, seconds=0)
    for name in ("scheduler", "worker", "triggerer"):
        services.start(name)
    waiting = f"Redis at 127.0.0.1:{port} is unreachable"
    for name in ("scheduler", "worker", "triggerer"):
        wait_for(lambda name=name: waiting in services.log(name), timeout=60, what=name)
    assert all(proc.poll() is None for proc in services.procs.values())
    assert services.run("dags", "trigger", "e2e_late_redis").returncode == 0

    redis_proc = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
    )
    try:
        wait_for(lambda: _all(sessions, "success", 2), timeout=90, what="the run to succeed")
        for name in ("scheduler", "worker", "triggerer"):
            log = services.log(name)
            assert log.count(waiting) == 1, log  # one line, however long the wait
            assert f"Redis at 127.0.0.1:{port} is up" in log
    finally:
        services.stop_all()
        redis_proc.terminate()
        redis_proc.wait(timeout=30)


BREAKING_DAG = """
import datetime as dt

from deferral import DAG, BaseOperator
from deferral.triggers import TimeDeltaTrigger


class WaitsLong(BaseOperator):
    def execute(self, context):
        self.defer(trigger=TimeDeltaTrigger(dt.timedelta(minutes=10)), method_name="resume")

    def resume(self, context, event):
        return "unreachable"


with DAG("e2e_breaks") as dag:
    WaitsLong(task_id="waits")
"""


def test_a_run_whose_dag_stops_importing_fails_after_the_grace_period(
    services: Services, write_dag: Any, sessions: sessionmaker[Session]
) -> None:
    path = write_dag("e2e_breaks_dag", BREAKING_DAG)
    services.env["DEFERRAL_DAG_IMPORT_GRACE_SEC"] = "3"
    services.env["DEFERRAL_DAG_REFRESH_SEC"] = "1"
    services.start("scheduler")
    services.start("worker")
    services.start("triggerer")
    assert services.run("dags", "trigger", "e2e_breaks").returncode == 0
    wait_for(lambda: _states(sessions).get("waits") == "deferred", timeout=60, what="deferral")

    path.write_text(BREAKING_DAG + "\ndef broken(:\n")
    stat = path.stat()
    os.utime(path, (stat.st_atime, stat.st_mtime + 5))
    # Meanwhile the doctor shows it; then the run fails with the import error.
    wait_for(
        lambda: "broken DAGs: 1 DAG not loading: e2e_breaks" in services.run("doctor").stdout,
        timeout=60,
        what="the doctor to show the broken DAG",
    )
    wait_for(lambda: _states(sessions).get("waits") == "failed", timeout=60, what="failed")
    wait_for(lambda: _run_state(sessions) == "failed", timeout=30, what="the run to fail")
    with sessions() as session:
        reason = session.scalar(
            select(TaskStateChange.reason).where(TaskStateChange.to_state == "failed")
        )
    assert reason is not None
    assert reason.startswith("DAG e2e_breaks cannot be loaded: SyntaxError: invalid syntax")
