"""Redis loses every key of ours while 200 tasks are deferred and services are being killed and
restarted: Postgres is the truth, the reconciler puts back what is missing, and every task still
finishes exactly once. The tasks wait on a gate (a file the test creates once the churn is over
and the reconciler has republished), not on a moment guessed long enough ahead."""

from __future__ import annotations

import random
import signal
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

from broker.client import Broker
from deferral.store.tables import TaskInstance, TaskStateChange
from tests.e2e.conftest import Services
from tests.helpers import wait_for

pytestmark = pytest.mark.e2e

N = 200

DAG = """
import datetime as dt

from deferral import DAG, BaseOperator
from deferral.triggers import FileTrigger

GATE = {gate!r}


class Wait(BaseOperator):
    def execute(self, context):
        self.defer(trigger=FileTrigger(GATE, poll_interval=2.0), method_name="resume")

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
    "worker": ("--concurrency", "4"),
    "worker2": ("--concurrency", "4"),
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


def _restart(services: Services, procs: dict[str, Any], name: str) -> None:
    """kill -9 ``name``, start it again, and wait until it is up."""
    procs[name].send_signal(signal.SIGKILL)
    procs[name].wait()
    before = services.starts(name)
    procs[name] = services.start(name, *SERVICES[name])
    services.wait_up(name, before)


def test_every_key_wiped_under_churn(
    services: Services,
    write_dag: Any,
    sessions: sessionmaker[Session],
    broker: Broker,
    tmp_path: Path,
) -> None:
    gate = tmp_path / "gate"
    write_dag("e2e_wipe_dag", DAG.format(gate=str(gate), n=N))
    procs = {name: services.start(name, *args) for name, args in SERVICES.items()}
    assert services.run("dags", "trigger", "e2e_wipe").returncode == 0
    wait_for(lambda: _counts(sessions).get("deferred") == N, timeout=180, what="all deferred")

    # Every service killed once in a random order, Redis wiped halfway through the churn.
    rng = random.Random(20261123)
    order = rng.sample(sorted(SERVICES), len(SERVICES))
    for name in order[:3]:
        _restart(services, procs, name)
    keys = list(broker.redis.scan_iter(match=f"{broker.keys.prefix}:*"))
    assert keys
    broker.redis.delete(*keys)
    for name in order[3:]:
        _restart(services, procs, name)

    # Nothing fires before the gate opens: every task is still deferred, and the reconciler
    # has put their triggers back in the stream Redis lost.
    wait_for(
        lambda: "reconciler: republished" in services.log("scheduler") + services.log("scheduler2"),
        timeout=120,
        what="the reconciler to republish",
    )
    wait_for(
        lambda: (
            sum(
                int(broker.redis.hlen(broker.keys.inflight(stream)))
                for stream in broker.keys.triggers_of("default")
            )
            == N
        ),
        timeout=120,
        what=f"all {N} triggers back in their stream",
    )
    assert _counts(sessions) == {"deferred": N}
    gate.write_text("open")

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
    assert broker.redis.xlen(broker.keys.dead) == 0
