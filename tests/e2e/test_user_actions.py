"""Users clear and mark tasks: a deferred task lets go of its trigger (on_kill runs, the entry
goes), a cleared task runs again as a new try, and a finished run runs again."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from broker.client import Broker
from deferral.store import tasklogs
from deferral.store.tables import DagRun, TaskInstance
from tests.e2e.conftest import Services
from tests.helpers import wait_for

pytestmark = pytest.mark.e2e

TRIGGERS = """
import logging

import anyio
from deferral.triggers import BaseTrigger, TriggerEvent


class Forever(BaseTrigger):
    def __init__(self, killed_file):
        super().__init__()
        self.killed_file = killed_file

    def serialize(self):
        return "e2e_user_triggers.Forever", {"killed_file": self.killed_file}

    async def run(self):
        logging.getLogger("e2e.forever").info("waiting for ever")
        await anyio.sleep_forever()
        yield TriggerEvent(None)

    async def on_kill(self):
        with open(self.killed_file, "w") as f:
            f.write("killed")
"""

DAG = """
import os

from deferral import DAG, BaseOperator
from deferral.operators import PythonOperator
from e2e_user_triggers import Forever

KILLED = {killed!r}
FIXED = {fixed!r}


class WaitsForever(BaseOperator):
    def execute(self, context):
        self.defer(trigger=Forever(KILLED), method_name="resume")

    def resume(self, context, event):
        return "unreachable"


def flaky():
    if not os.path.exists(FIXED):
        raise RuntimeError("not fixed yet")
    return "fixed"


with DAG("e2e_user") as dag:
    WaitsForever(task_id="waits") >> PythonOperator(task_id="after_wait", python_callable=str)
    PythonOperator(task_id="flaky", python_callable=flaky) >> PythonOperator(
        task_id="after_flaky", python_callable=str
    )
"""


def _states(sessions: sessionmaker[Session]) -> dict[str, str]:
    with sessions() as session:
        return {ti.task_id: ti.state for ti in session.scalars(select(TaskInstance))}


def _task_log(sessions: sessionmaker[Session], task_id: str) -> str:
    """The log of the task's first try, as one text."""
    with sessions() as session:
        ti = session.scalars(select(TaskInstance).where(TaskInstance.task_id == task_id)).one()
        return "\n".join(line.text for line in tasklogs.read_lines(session, ti.id, 1))


def _run_state(sessions: sessionmaker[Session]) -> str | None:
    with sessions() as session:
        return session.scalar(select(DagRun.state))


def test_mark_a_deferred_task_and_clear_a_failed_one(
    services: Services,
    write_dag: Any,
    sessions: sessionmaker[Session],
    broker: Broker,
    tmp_path: Path,
) -> None:
    killed, fixed = tmp_path / "killed", tmp_path / "fixed"
    write_dag("e2e_user_triggers", TRIGGERS)
    write_dag("e2e_user_dag", DAG.format(killed=str(killed), fixed=str(fixed)))
    services.env["DEFERRAL_TRIGGER_MODULES"] = "deferral.triggers,e2e_user_triggers"
    services.start("scheduler")
    services.start("worker", "--concurrency", "2")
    services.start("triggerer")
    assert services.run("dags", "trigger", "e2e_user", "--run-id", "r1").returncode == 0
    wait_for(
        lambda: (s := _states(sessions)).get("waits") == "deferred" and s.get("flaky") == "failed",
        timeout=60,
        what="waits deferred and flaky failed",
    )
    wait_for(lambda: _states(sessions)["after_flaky"] == "upstream_failed", what="propagation")

    # Mark the deferred task: its trigger is cancelled (on_kill), its downstream runs.
    marked = services.run("tasks", "mark", "e2e_user", "r1", "waits", "--state", "success")
    assert marked.returncode == 0, marked.stderr
    assert "waits: success" in marked.stdout
    wait_for(lambda: killed.exists(), timeout=30, what="the trigger's on_kill")
    assert "cancelled (reason: user_action)" in services.log("triggerer")
    # The trigger's own line and the cancellation are in the log of the try that deferred.
    wait_for(
        lambda: (
            "INFO e2e.forever: waiting for ever" in (log := _task_log(sessions, "waits"))
            and "cancelled (reason: user_action)" in log
        ),
        timeout=30,
        what="the triggerer's lines in the task's log",
    )
    wait_for(lambda: _run_state(sessions) == "failed", timeout=30, what="the run to finish")
    assert _states(sessions)["after_wait"] == "success"
    wait_for(lambda: broker.redis.xlen(broker.keys.triggers) == 0, what="the entry to go")

    # Fix the cause and clear the failed task with its downstream: the run runs again.
    fixed.write_text("yes")
    cleared = services.run("tasks", "clear", "e2e_user", "r1", "flaky", "--downstream")
    assert cleared.returncode == 0, cleared.stderr
    wait_for(lambda: _run_state(sessions) == "success", timeout=60, what="the run to succeed")
    with sessions() as session:
        flaky = session.scalars(select(TaskInstance).where(TaskInstance.task_id == "flaky")).one()
    assert (flaky.state, flaky.try_number) == ("success", 2)
    assert _states(sessions)["after_flaky"] == "success"


def test_queued_or_running_tasks_are_not_changed(
    services: Services, write_dag: Any, sessions: sessionmaker[Session], tmp_path: Path
) -> None:
    write_dag("e2e_user_triggers", TRIGGERS)
    write_dag("e2e_user_dag", DAG.format(killed=str(tmp_path / "k"), fixed=str(tmp_path / "f")))
    services.start("scheduler")  # no worker: tasks stay queued
    assert services.run("dags", "trigger", "e2e_user", "--run-id", "r1").returncode == 0
    wait_for(lambda: _states(sessions).get("flaky") == "queued", timeout=60, what="queued")
    refused = services.run("tasks", "mark", "e2e_user", "r1", "flaky", "--state", "success")
    assert refused.returncode == 1
    assert "error: not changed while queued or running: flaky (queued)" in refused.stderr
    unknown = services.run("tasks", "clear", "e2e_user", "r1", "nope")
    assert unknown.returncode == 1
    assert "error: DAG 'e2e_user' has no task 'nope'" in unknown.stderr
