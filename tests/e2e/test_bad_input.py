"""Bad input fails the one task it concerns, with a message naming the fault, and nothing else."""

from __future__ import annotations

import subprocess
from typing import Any

import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from broker.client import Broker
from broker.streams import TriggerMessage
from deferral.models import TaskInstance, TaskStateChange
from tests.e2e.conftest import Services, command
from tests.helpers import wait_for

pytestmark = pytest.mark.e2e

BAD_DAG = """
import datetime as dt

from deferral import DAG, BaseOperator
from deferral.operators import PythonOperator
from deferral.triggers import TimeDeltaTrigger


class DefersBadKwarg(BaseOperator):
    def execute(self, context):
        self.defer(
            trigger=TimeDeltaTrigger(dt.timedelta(seconds=1)),
            method_name="resume",
            kwargs={"handle": object()},
        )

    def resume(self, context, event, handle):
        return "unreachable"


class WaitsLong(BaseOperator):
    def execute(self, context):
        self.defer(trigger=TimeDeltaTrigger(dt.timedelta(minutes=10)), method_name="resume")

    def resume(self, context, event):
        return "resumed"


with DAG("e2e_bad") as dag:
    DefersBadKwarg(task_id="bad_kwarg")
    WaitsLong(task_id="waits")
    PythonOperator(task_id="healthy", python_callable=lambda: "fine")
"""


def _ti(sessions: sessionmaker[Session], task_id: str) -> TaskInstance | None:
    with sessions() as session:
        return session.scalars(select(TaskInstance).where(TaskInstance.task_id == task_id)).first()


def _last_reason(sessions: sessionmaker[Session], ti_id: int) -> str:
    with sessions() as session:
        reason = session.scalars(
            select(TaskStateChange.reason)
            .where(TaskStateChange.task_instance_id == ti_id)
            .order_by(TaskStateChange.id.desc())
        ).first()
    return reason or ""


def test_bad_kwarg_and_forged_trigger_entry_fail_only_their_task(
    services: Services, write_dag: Any, sessions: sessionmaker[Session], broker: Broker
) -> None:
    write_dag("e2e_bad_dag", BAD_DAG)
    # A queue entry that is not a task attempt is dead-lettered before anything runs.
    broker.publish(broker.keys.queue("default"), {"task_instance_id": "seven"})
    services.start("scheduler")
    services.start("worker", "--concurrency", "2")
    services.start("triggerer")
    assert services.run("dags", "trigger", "e2e_bad").returncode == 0

    # A kwarg that cannot be serialized is refused at defer time, naming the key and its type.
    bad = wait_for(
        lambda: (ti := _ti(sessions, "bad_kwarg")) and ti.state == "failed" and ti, timeout=60
    )
    assert "defer kwargs['handle'] has unsupported type object" in _last_reason(sessions, bad.id)

    # A forged entry naming a deferred task's trigger is dead-lettered, never imported, and that
    # task fails with the reason.
    waits = wait_for(
        lambda: (ti := _ti(sessions, "waits")) and ti.state == "deferred" and ti, timeout=60
    )
    forged = TriggerMessage(
        trigger_id=str(waits.trigger_id),
        classpath="os.system",
        task="e2e_bad.forged.waits",
        token="gAAAAAB-not-a-real-token",
    )
    broker.publish(broker.keys.triggers, forged)
    wait_for(
        lambda: (ti := _ti(sessions, "waits")) and ti.state == "failed", timeout=60, what="failed"
    )
    assert "rejected trigger entry" in _last_reason(sessions, waits.id)
    dead = wait_for(
        lambda: len(entries := broker.xrange(broker.keys.dead)) == 2 and entries,
        what="two dead letters",
    )
    assert dead[0].fields[b"task_instance_id"] == b"seven"
    assert dead[0].fields[b"error"].startswith(b"bad queue entry: malformed QueueMessage")
    assert dead[1].fields[b"classpath"] == b"os.system"
    assert b"token failed authentication" in dead[1].fields[b"error"]

    # Everything else carried on.
    healthy = _ti(sessions, "healthy")
    assert healthy is not None and healthy.state == "success"
    assert all(proc.poll() is None for proc in services.procs.values())


def test_a_missing_setting_stops_each_service_with_one_line_naming_it(
    services: Services,
) -> None:
    env = {k: v for k, v in services.env.items() if k != "DEFERRAL_FERNET_KEY"}
    for name in ("scheduler", "worker", "triggerer"):
        done = subprocess.run(
            command(name, "consume"), env=env, capture_output=True, text=True, timeout=60
        )
        assert done.returncode == 2, done.stderr
        assert done.stderr.strip().splitlines() == ["error: DEFERRAL_FERNET_KEY is not set"]

    malformed = {**services.env, "DEFERRAL_HEARTBEAT_SEC": "soon"}
    done = subprocess.run(
        command("triggerer", "consume"), env=malformed, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2
    assert done.stderr.strip().startswith("error: DEFERRAL_HEARTBEAT_SEC is malformed")
    assert len(done.stderr.strip().splitlines()) == 1
