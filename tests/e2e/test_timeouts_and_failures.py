"""execution_timeout runs across deferrals, and a trigger that raises fails its task with the
trigger's error — through the real processes."""

from __future__ import annotations

from typing import Any

import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from deferral.store import tasklogs
from deferral.store.tables import TaskInstance, TaskStateChange
from tests.e2e.conftest import Services
from tests.helpers import wait_for

pytestmark = pytest.mark.e2e

FAILING_TRIGGERS = """
from deferral.triggers import BaseTrigger, TriggerEvent


class Explodes(BaseTrigger):
    def serialize(self):
        return "e2e_failing_triggers.Explodes", {}

    async def run(self):
        raise ValueError("the external job vanished")
        yield TriggerEvent(None)
"""

DAG = """
import datetime as dt
import time

from deferral import DAG, BaseOperator
from deferral.operators import PythonOperator
from deferral.triggers import TimeDeltaTrigger
from e2e_failing_triggers import Explodes


class WaitsPastItsDeadline(BaseOperator):
    def execute(self, context):
        self.defer(trigger=TimeDeltaTrigger(dt.timedelta(minutes=10)), method_name="resume")

    def resume(self, context, event):
        return "unreachable"


class DefersOnExplodes(BaseOperator):
    def execute(self, context):
        self.defer(trigger=Explodes(), method_name="resume")

    def resume(self, context, event):
        return "unreachable"


with DAG("e2e_limits") as dag:
    PythonOperator(
        task_id="runs_too_long",
        python_callable=lambda: time.sleep(30),
        execution_timeout=dt.timedelta(seconds=1),
    )
    WaitsPastItsDeadline(task_id="deferral_capped", execution_timeout=dt.timedelta(seconds=5))
    DefersOnExplodes(task_id="trigger_raises")
"""


def _final(sessions: sessionmaker[Session], task_id: str) -> tuple[str, str] | None:
    """(state, last recorded reason) once the task failed."""
    with sessions() as session:
        ti = session.scalars(
            select(TaskInstance).where(TaskInstance.task_id == task_id)
        ).one_or_none()
        if ti is None:
            return None  # the run has not started yet
        reason = session.scalars(
            select(TaskStateChange.reason)
            .where(TaskStateChange.task_instance_id == ti.id)
            .order_by(TaskStateChange.id.desc())
        ).first()
    return (ti.state, reason or "") if ti.state == "failed" else None


def _first_try_log(sessions: sessionmaker[Session], task_id: str) -> str:
    with sessions() as session:
        ti = session.scalars(select(TaskInstance).where(TaskInstance.task_id == task_id)).one()
        return "\n".join(line.text for line in tasklogs.read_lines(session, ti.id, 1))


def test_execution_timeout_and_trigger_failures(
    services: Services, write_dag: Any, sessions: sessionmaker[Session]
) -> None:
    write_dag("e2e_failing_triggers", FAILING_TRIGGERS)
    write_dag("e2e_limits_dag", DAG)
    services.env["DEFERRAL_TRIGGER_MODULES"] = "deferral.triggers,e2e_failing_triggers"
    services.start("scheduler")
    services.start("worker", "--concurrency", "2")
    services.start("triggerer")
    assert services.run("dags", "trigger", "e2e_limits").returncode == 0

    _, reason = wait_for(lambda: _final(sessions, "runs_too_long"), timeout=60)
    assert reason.startswith("TaskExecutionTimeout: execution_timeout passed")

    # Deferred on a 10-minute trigger, but the try's execution_timeout (5 s) caps the deferral.
    _, reason = wait_for(lambda: _final(sessions, "deferral_capped"), timeout=60)
    assert reason == "TaskDeferralTimeout: the deferral timed out before its trigger fired"

    _, reason = wait_for(lambda: _final(sessions, "trigger_raises"), timeout=60)
    assert reason.startswith("TaskDeferralError: trigger ")
    assert "raised ValueError: the external job vanished" in reason
    # The try's log has the triggerer's failure with its traceback, and the capped deferral's
    # trigger cancelled for its timeout.
    log = _first_try_log(sessions, "trigger_raises")
    assert "raised ValueError: the external job vanished\nTraceback" in log
    assert "ERROR deferral.triggerer: trigger " in log
    wait_for(
        lambda: "cancelled (reason: timeout)" in _first_try_log(sessions, "deferral_capped"),
        timeout=30,
        what="the capped deferral's cancellation in its log",
    )
