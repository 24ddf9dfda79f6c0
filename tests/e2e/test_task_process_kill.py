"""kill -9 of a task process mid-attempt (the worker survives): the attempt fails into its retry,
and the retry runs in a fresh task process."""

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


def killed_first_try(ti):
    with open(MARKS, "a") as marks:
        marks.write(f"{{ti.try_number}} {{os.getpid()}}\\n")
    if ti.try_number == 1:
        time.sleep(300)  # killed meanwhile
    return f"done on try {{ti.try_number}}"


with DAG("e2e_task_process_kill") as dag:
    PythonOperator(
        task_id="victim", python_callable=killed_first_try, retries=1,
        retry_delay=dt.timedelta(0),
    )
"""


def test_a_killed_task_process_fails_its_attempt_into_a_retry_in_a_fresh_process(
    services: Services, write_dag: Any, sessions: sessionmaker[Session], tmp_path: Path
) -> None:
    marks = tmp_path / "marks.txt"
    write_dag("e2e_task_process_kill_dag", DAG.format(marks=str(marks)))
    services.start("scheduler")
    worker = services.start("worker", "--concurrency", "1")
    assert services.run("dags", "trigger", "e2e_task_process_kill").returncode == 0
    wait_for(lambda: marks.exists() and marks.read_text(), timeout=60, what="try 1 to start")
    first_pid = int(marks.read_text().split()[1])

    os.kill(first_pid, signal.SIGKILL)

    def finished() -> TaskInstance | None:
        with sessions() as session:
            ti = session.scalars(select(TaskInstance)).one()
        return ti if ti.state == "success" else None

    ti = wait_for(finished, timeout=90, what="the retry to succeed")
    assert ti.try_number == 2
    assert worker.poll() is None  # the worker lived on
    tries = [line.split() for line in marks.read_text().splitlines()]
    assert [t[0] for t in tries] == ["1", "2"]
    assert int(tries[1][1]) != first_pid  # the retry ran in another process
    with sessions() as session:
        changes = session.execute(
            select(TaskStateChange.from_state, TaskStateChange.to_state).order_by(
                TaskStateChange.id
            )
        ).all()
    assert ("running", "up_for_retry") in [tuple(c) for c in changes]
