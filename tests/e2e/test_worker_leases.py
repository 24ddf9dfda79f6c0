"""A worker killed with -9 mid-attempt: its attempt is detected after 2.1 x heartbeat, failed into
a retry (never lost), its child process died with it (never run twice at once), and the retry
runs on another worker. A worker stopped with SIGTERM hands an attempt that outlives its stop
grace back: it runs again elsewhere at the same try, no try counted."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from deferral.store.tables import TaskInstance, TaskStateChange
from tests.e2e.conftest import Services
from tests.helpers import wait_for

pytestmark = pytest.mark.e2e

DAG = """
import datetime as dt
import os
import time

from deferral import DAG
from deferral.operators import PythonOperator

MARKS = {marks!r}


def slow_first_try(ti):
    with open(MARKS, "a") as marks:
        marks.write(f"{{ti.try_number}} {{os.getpid()}}\\n")
    if ti.try_number == 1:
        time.sleep(120)
    return f"done on try {{ti.try_number}}"


with DAG("e2e_worker_lease") as dag:
    PythonOperator(
        task_id="slow", python_callable=slow_first_try, retries=1, retry_delay=dt.timedelta(0)
    )
"""


# retries=0: a try counted against the task would fail it.
STOPPED_DAG = """
import os
import time

from deferral import DAG
from deferral.operators import PythonOperator

MARKS = {marks!r}


def slow_first_run(ti):
    with open(MARKS, "a") as marks:
        marks.write(f"{{ti.try_number}} {{os.getpid()}}\\n")
    with open(MARKS) as marks:
        if len(marks.readlines()) == 1:
            time.sleep(120)
    return "done"


with DAG("e2e_worker_stop") as dag:
    PythonOperator(task_id="slow", python_callable=slow_first_run, retries=0)
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _succeeded(sessions: sessionmaker[Session]) -> TaskInstance | None:
    with sessions() as session:
        ti = session.scalars(select(TaskInstance)).one()
    return ti if ti.state == "success" else None


def _changes(sessions: sessionmaker[Session]) -> list[tuple[str, str]]:
    with sessions() as session:
        rows = session.execute(
            select(TaskStateChange.to_state, TaskStateChange.reason).order_by(TaskStateChange.id)
        ).all()
    return [(row.to_state, row.reason) for row in rows]


def test_a_killed_workers_attempt_is_retried_elsewhere_and_its_child_dies(
    services: Services, write_dag: Any, sessions: sessionmaker[Session], tmp_path: Path
) -> None:
    marks = tmp_path / "marks.txt"
    write_dag("e2e_worker_lease_dag", DAG.format(marks=str(marks)))
    services.start("scheduler")
    doomed = services.start("worker", "--concurrency", "1", "--name", "doomed")
    assert services.run("dags", "trigger", "e2e_worker_lease").returncode == 0
    wait_for(lambda: marks.exists() and marks.read_text(), timeout=60, what="try 1 to start")
    child_pid = int(marks.read_text().split()[1])
    # The task process's parent: the worker's fork server, which must not outlive it either.
    fork_server = int(Path(f"/proc/{child_pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    assert fork_server != doomed.pid

    doomed.kill()
    doomed.wait()
    wait_for(lambda: not _alive(child_pid), timeout=10, what="the orphaned attempt to die")
    wait_for(lambda: not _alive(fork_server), timeout=10, what="the fork server to exit")
    services.start("worker2", "--concurrency", "1", "--name", "survivor")

    ti = wait_for(lambda: _succeeded(sessions), timeout=60, what="the retry to succeed")
    assert ti.try_number == 2 and ti.worker == "survivor"
    assert ("up_for_retry", "worker doomed stopped heartbeating") in _changes(sessions)
    assert [line.split()[0] for line in marks.read_text().splitlines()] == ["1", "2"]


def test_a_stopped_workers_attempt_past_its_grace_is_handed_back_at_the_same_try(
    services: Services, write_dag: Any, sessions: sessionmaker[Session], tmp_path: Path
) -> None:
    marks = tmp_path / "marks.txt"
    write_dag("e2e_worker_stop_dag", STOPPED_DAG.format(marks=str(marks)))
    services.env["DEFERRAL_WORKER_STOP_GRACE_SEC"] = "0.5"
    services.start("scheduler")
    leaving = services.start("worker", "--concurrency", "1", "--name", "leaving")
    assert services.run("dags", "trigger", "e2e_worker_stop").returncode == 0
    wait_for(lambda: marks.exists() and marks.read_text(), timeout=60, what="the attempt to start")
    child_pid = int(marks.read_text().split()[1])

    leaving.send_signal(signal.SIGTERM)
    assert leaving.wait(timeout=30) == 0
    assert not _alive(child_pid)  # killed once the grace ran out, before the worker exited
    services.start("worker2", "--concurrency", "1", "--name", "staying")

    ti = wait_for(lambda: _succeeded(sessions), timeout=60, what="the attempt to run again")
    assert ti.try_number == 1 and ti.worker == "staying"
    handed_back = [
        reason for state, reason in _changes(sessions) if state == "scheduled" and "grace" in reason
    ]
    assert handed_back == [
        "worker leaving stopped and its stop grace (0.5 s) ran out: killed its process and handed"
        " it back to run again at the same try"
    ]
    assert [line.split()[0] for line in marks.read_text().splitlines()] == ["1", "1"]
    assert "handed back" in services.log("worker")
