"""Redis loses every key of ours while 200 tasks are deferred and services are being killed and
restarted: Postgres is the truth, the reconciler puts back what is missing, and every task still
finishes exactly once."""

from __future__ import annotations

import datetime as dt
import random
import signal
import time
from typing import Any

import pytest
from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

from broker.client import Broker
from deferral.models import TaskInstance, TaskStateChange
from tests.e2e.conftest import Services
from tests.helpers import wait_for

pytestmark = pytest.mark.e2e

N = 200

DAG = """
import datetime as dt

from deferral import DAG, BaseOperator
from deferral.triggers import DateTimeTrigger

MOMENT = dt.datetime.fromisoformat("{moment}")


class Wait(BaseOperator):
    def execute(self, context):
        offset = int(self.task_id[1:]) % 5
        self.defer(
            trigger=DateTimeTrigger(MOMENT + dt.timedelta(seconds=offset)), method_name="resume"
        )

    def resume(self, context, event):
        return "resumed"


with DAG("e2e_wipe", max_active_tasks={n}) as dag:
    for i in range({n}):
        # A worker killed mid-attempt fails that try into a retry.
        Wait(task_id=f"t{{i}}", retries=5, retry_delay=dt.timedelta(0))
"""

SERVICES = {
    "scheduler": (),
    "scheduler2": (),
    "worker": ("--concurrency", "8"),
    "worker2": ("--concurrency", "8"),
    "triggerer": (),
    "triggerer2": (),
}


def _counts(sessions: sessionmaker[Session]) -> dict[str, int]:
    with sessions() as session:
        return dict(
            session.execute(
                select(TaskInstance.state, func.count()).group_by(TaskInstance.state)
            ).all()
        )


def test_every_key_wiped_under_churn(
    services: Services, write_dag: Any, sessions: sessionmaker[Session], broker: Broker
) -> None:
    moment = dt.datetime.now(dt.UTC) + dt.timedelta(seconds=45)
    write_dag("e2e_wipe_dag", DAG.format(moment=moment.isoformat(), n=N))
    procs = {name: services.start(name, *args) for name, args in SERVICES.items()}
    assert services.run("dags", "trigger", "e2e_wipe").returncode == 0
    wait_for(lambda: _counts(sessions).get("deferred") == N, timeout=120, what="all deferred")

    rng = random.Random(20261123)
    wiped = False
    churn_until = time.monotonic() + 15
    while time.monotonic() < churn_until:
        name = rng.choice(sorted(SERVICES))
        procs[name].send_signal(signal.SIGKILL)
        procs[name].wait()
        if not wiped and time.monotonic() > churn_until - 8:
            keys = list(broker.redis.scan_iter(match=f"{broker.keys.prefix}:*"))
            broker.redis.delete(*keys)
            wiped = True
        time.sleep(0.5)
        procs[name] = services.start(name, *SERVICES[name])
        time.sleep(1.0)
    assert wiped

    wait_for(lambda: _counts(sessions) == {"success": N}, timeout=240, what=f"all {N} to succeed")
    with sessions() as session:
        successes = dict(
            session.execute(
                select(TaskInstance.task_id, func.count())
                .join(TaskStateChange, TaskStateChange.task_instance_id == TaskInstance.id)
                .where(TaskStateChange.to_state == "success")
                .group_by(TaskInstance.task_id)
            ).all()
        )
    assert successes == {f"t{i}": 1 for i in range(N)}
    logs = services.log("scheduler") + services.log("scheduler2")
    assert "reconciler: republished" in logs
    assert broker.redis.xlen(broker.keys.dead) == 0
