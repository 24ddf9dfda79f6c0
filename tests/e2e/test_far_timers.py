"""A far timer through real processes (issue 30): a task deferring beyond the horizon waits as a
row; the scheduler publishes it when near, the triggerer fires it, and the task resumes once."""

from __future__ import annotations

import subprocess
from typing import Any

import pytest
from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

from deferral.store.tables import TaskInstance, TaskStateChange
from tests.e2e.conftest import Services, command

pytestmark = pytest.mark.e2e

# Deferred 4 s ahead with a horizon of 2 s: a far timer for its first 2 s.
FAR_DAG = """
import datetime as dt

from deferral import DAG, BaseOperator
from deferral.triggers import TimeDeltaTrigger


class Nap(BaseOperator):
    def execute(self, context):
        self.defer(trigger=TimeDeltaTrigger(dt.timedelta(seconds=4)), method_name="resume")

    def resume(self, context, event):
        return event.isoformat()


with DAG("e2e_far") as dag:
    Nap(task_id="nap")
"""


def test_a_far_timer_is_published_by_the_scheduler_when_near_and_resumes_once(
    services: Services, write_dag: Any, sessions: sessionmaker[Session]
) -> None:
    write_dag("e2e_far_dag", FAR_DAG)
    horizon = {"DEFERRAL_FAR_TIMER_HORIZON_SEC": "2"}
    for name in ("scheduler", "worker", "triggerer"):
        services.start(name, env=horizon)
    services.parsed("e2e_far")  # what `dags trigger` reads
    done = subprocess.run(
        command("deferral", "dags", "trigger", "e2e_far", "--wait", "--timeout", "90"),
        env=services.env,
        capture_output=True,
        text=True,
        timeout=120,
    )

    assert done.returncode == 0, done.stdout + done.stderr
    assert "a far timer, published 0:00:02 before its moment" in services.log("worker")
    assert "published 1 far timer(s)" in services.log("scheduler")
    with sessions() as session:
        resumes = session.scalar(
            select(func.count())
            .select_from(TaskStateChange)
            .join(TaskInstance, TaskInstance.id == TaskStateChange.task_instance_id)
            .where(
                TaskInstance.task_id == "nap",
                TaskStateChange.from_state == "deferred",
                TaskStateChange.to_state == "scheduled",
            )
        )
        state = session.scalar(select(TaskInstance.state).where(TaskInstance.task_id == "nap"))
    assert (resumes, state) == (1, "success")
