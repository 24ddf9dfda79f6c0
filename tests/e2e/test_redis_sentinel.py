"""The services on Redis Sentinel: one primary, one replica and three sentinels on loopback
ports (``redis+sentinel://…/deferral``), started for this module. The primary is killed (kill -9)
while tasks are deferred and running; the sentinels promote the replica, the services reconnect
to it, and every task finishes exactly once."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

from deferral.store.tables import TaskStateChange
from tests.e2e.conftest import Services
from tests.e2e.test_redis_wipe_under_churn import DAG as GATED_DAG
from tests.e2e.test_redis_wipe_under_churn import _counts
from tests.helpers import wait_for
from tests.redis_topologies import LocalSentinel, redis_binaries_found, running

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(not redis_binaries_found(), reason="redis-server/redis-cli not found"),
]

N = 100


@pytest.fixture(scope="module")
def redis_sentinel(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalSentinel]:
    yield from running(LocalSentinel(tmp_path_factory.mktemp("sentinel")))


@pytest.fixture(scope="module")
def redis_url(redis_sentinel: LocalSentinel) -> str:
    return redis_sentinel.url


def test_services_follow_the_promoted_replica_and_every_task_finishes_once(
    redis_sentinel: LocalSentinel,
    services: Services,
    write_dag: Any,
    sessions: sessionmaker[Session],
    tmp_path: Path,
) -> None:
    gate = tmp_path / "gate"
    dag = GATED_DAG.replace("e2e_wipe", "e2e_sentinel")
    write_dag("e2e_sentinel_dag", dag.format(gate=str(gate), n=N))
    for name in ("scheduler", "worker", "triggerer"):
        services.start(name)
    assert services.run("dags", "trigger", "e2e_sentinel").returncode == 0
    wait_for(lambda: _counts(sessions).get("deferred", 0) >= N // 2, timeout=300, what="deferrals")

    redis_sentinel.kill_primary()
    gate.write_text("open")

    wait_for(lambda: _counts(sessions) == {"success": N}, timeout=600, what=f"all {N} to succeed")
    with sessions() as session:
        successes = session.execute(
            select(func.count())
            .select_from(TaskStateChange)
            .where(TaskStateChange.to_state == "success")
        ).scalar_one()
    assert successes == N
