"""Redis loses everything (a restart without persistence) while a task is deferred and another
is queued: the scheduler's reconciler publishes their entries again from Postgres and both runs
finish."""

from __future__ import annotations

import signal
from typing import Any

import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from broker.client import Broker
from deferral.store.tables import DagRun, TaskInstance
from tests.e2e.conftest import Services
from tests.helpers import wait_for

pytestmark = pytest.mark.e2e

DAG = """
import datetime as dt

from deferral import DAG, BaseOperator
from deferral.operators import EmptyOperator
from deferral.triggers import TimeDeltaTrigger


class Wait(BaseOperator):
    def execute(self, context):
        self.defer(trigger=TimeDeltaTrigger(dt.timedelta(seconds=3)), method_name="resume")

    def resume(self, context, event):
        return "resumed"


with DAG("e2e_waits") as waits:
    Wait(task_id="wait")

with DAG("e2e_plain") as plain:
    EmptyOperator(task_id="plain")
"""


def _run_states(sessions: sessionmaker[Session]) -> dict[str, str]:
    with sessions() as session:
        return {r.dag_id: r.state for r in session.execute(select(DagRun.dag_id, DagRun.state))}


def _task_state(sessions: sessionmaker[Session], task_id: str) -> str | None:
    with sessions() as session:
        return session.scalar(select(TaskInstance.state).where(TaskInstance.task_id == task_id))


def test_streams_are_rebuilt_from_postgres_after_redis_lost_everything(
    services: Services, write_dag: Any, sessions: sessionmaker[Session], broker: Broker
) -> None:
    write_dag("e2e_redis_loss_dags", DAG)
    services.start("scheduler")
    worker = services.start("worker", "--concurrency", "1")
    triggerer = services.start("triggerer")
    assert services.run("dags", "trigger", "e2e_waits").returncode == 0
    wait_for(lambda: _task_state(sessions, "wait") == "deferred", timeout=60, what="deferral")

    # The worker stops, so the next task stays queued; the triggerer dies with its trigger.
    worker.send_signal(signal.SIGTERM)
    assert worker.wait(timeout=30) == 0
    triggerer.kill()
    triggerer.wait()
    assert services.run("dags", "trigger", "e2e_plain").returncode == 0
    wait_for(lambda: _task_state(sessions, "plain") == "queued", timeout=30, what="queued")

    # Redis loses every key of ours.
    keys = list(broker.redis.scan_iter(match=f"{broker.keys.prefix}:*"))
    broker.redis.delete(*keys)

    services.start("worker2", "--concurrency", "1")
    services.start("triggerer2")
    wait_for(
        lambda: _run_states(sessions) == {"e2e_waits": "success", "e2e_plain": "success"},
        timeout=60,
        what="both runs to finish",
    )
    log = services.log("scheduler")
    assert "reconciler: republished 1 trigger(s) that no stream held" in log
    assert "reconciler: republished 1 queued attempt(s) that no stream held" in log
