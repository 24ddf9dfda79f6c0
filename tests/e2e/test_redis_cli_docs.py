"""The Operations page's "Inspecting with redis-cli" examples, run with redis-cli against a real
deferral (a task waiting on a triggerer, and a forged event in the dead letters): each prints what
the page shows, up to ids, counts and times (tests/redis_cli_docs.py says exactly what may
differ).
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from broker.client import Broker
from deferral.store.tables import TaskInstance
from tests.e2e.conftest import Services
from tests.helpers import wait_for
from tests.redis_cli_docs import DOCUMENTED_PREFIX, differences, examples

pytestmark = pytest.mark.e2e

WAITING_DAG = """
import datetime as dt

from deferral import DAG, BaseOperator
from deferral.triggers import TimeDeltaTrigger


class WaitAnHour(BaseOperator):
    def execute(self, context):
        self.defer(trigger=TimeDeltaTrigger(dt.timedelta(hours=1)), method_name="done")

    def done(self, context, event):
        return None


with DAG("inspect_me") as dag:
    WaitAnHour(task_id="wait")
"""

# An events entry whose MAC is wrong: the scheduler dead-letters it and changes nothing.
FORGED_EVENT = {
    "trigger_id": "1",
    "dedup_key": "forged",
    "kind": "event",
    "payload": "{}",
    "triggerer": "someone",
    "mac": "not-a-mac",
}


def _redis_cli(url: str, prefix: str, args: list[str]) -> list[str]:
    redis_cli = shutil.which("redis-cli")
    assert redis_cli, "redis-cli is needed (Debian package redis-tools)"
    keys = [
        f"{prefix}:{arg.removeprefix(DOCUMENTED_PREFIX)}"
        if arg.startswith(DOCUMENTED_PREFIX)
        else arg
        for arg in args
    ]
    # --no-raw: the output redis-cli prints on a terminal, which the page shows.
    shown = subprocess.run(
        [redis_cli, "-u", url, "--no-raw", *keys], capture_output=True, text=True, timeout=30
    )
    assert shown.returncode == 0, shown.stderr
    return shown.stdout.rstrip("\n").splitlines()


def test_every_redis_cli_example_of_the_readme_prints_the_documented_shape(
    services: Services,
    service_env: dict[str, str],
    sessions: sessionmaker[Session],
    broker: Broker,
    write_dag: Callable[[str, str], Path],
) -> None:
    write_dag("inspect_me", WAITING_DAG)
    services.start("scheduler", "--name", "scheduler-1")
    services.start("worker", "--name", "worker-1", "--concurrency", "1")
    services.start("triggerer", "--name", "triggerer-1")
    services.wait_up("triggerer")  # its consumer group exists: the pending list can be asked
    triggered = services.run("dags", "trigger", "inspect_me")
    assert triggered.returncode == 0, triggered.stderr

    def held_by_the_triggerer() -> bool:
        with sessions() as session:
            state = session.scalars(select(TaskInstance.state)).first()
        pending = broker.pending(broker.keys.triggers, "triggerers")
        return state == "deferred" and pending.per_consumer == {"triggerer-1": 1}

    wait_for(held_by_the_triggerer, timeout=120, what="the trigger to run on triggerer-1")
    broker.redis.xadd(broker.keys.events, FORGED_EVENT)  # type: ignore[arg-type]
    wait_for(
        lambda: broker.redis.xlen(broker.keys.dead) == 1,
        timeout=60,
        what="the forged event to be dead-lettered",
    )

    documented = examples()
    assert len(documented) >= 6
    url, prefix = service_env["DEFERRAL_REDIS_URL"], service_env["DEFERRAL_STREAM_PREFIX"]
    report = []
    for example in documented:
        printed = _redis_cli(url, prefix, example.command)
        wrong = differences(example.output, printed)
        if wrong:
            report += [f"$ redis-cli {' '.join(example.command)}", *wrong, "printed:", *printed]
    assert not report, "\n".join(report)
