"""Assets through real processes: a producer's outlet makes one consumer run per success, whose
task reads its triggering_asset_events; a RedisStreamTrigger watcher turns 1,000 XADDs into
1,000 asset events and 1,000 asset-triggered runs, none twice, across a kill -9 of the triggerer
running it (a peer takes its lease over; entries read but not acknowledged are read again and
deduplicated); every entry ends acknowledged."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
import redis
from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

from deferral.store.tables import (
    AssetEventRow,
    AssetWatcherRow,
    DagRun,
    DagRunAssetEvent,
    TaskInstance,
    XCom,
)
from tests.e2e.conftest import Services
from tests.helpers import wait_for
from tests.servers import REDIS_URL

pytestmark = pytest.mark.e2e

DAG = """
from deferral import DAG
from deferral.assets import Asset, AssetWatcher
from deferral.triggers.event import RedisStreamTrigger

source = RedisStreamTrigger({url!r}, {stream!r}, "deferral", block_ms=200)
orders = Asset("orders_stream", watchers=[AssetWatcher("redis", source)])

with DAG("e2e_stream_consumer", schedule=[orders], max_active_runs=5000) as dag:
    pass
"""

ENTRIES = 1000


def _count(sessions: sessionmaker[Session], statement: Any) -> int:
    with sessions() as session:
        return int(session.scalar(statement) or 0)


def test_a_stream_watcher_makes_one_run_per_entry_across_a_kill_9(
    services: Services,
    sessions: sessionmaker[Session],
    write_dag: Any,
    stream_prefix: str,
) -> None:
    stream = f"{stream_prefix}:orders:{uuid.uuid4().hex[:6]}"
    write_dag("e2e_stream_consumer", DAG.format(url=REDIS_URL, stream=stream))
    client = redis.Redis.from_url(REDIS_URL)
    services.start("scheduler")
    doomed = services.start("triggerer", "--name", "doomed", "--heartbeat", "0.5")
    held = select(AssetWatcherRow.triggerer_id)
    wait_for(lambda: _count_holder(sessions, held) == "doomed", timeout=120, what="the lease")
    events = select(func.count()).select_from(AssetEventRow)
    for n in range(ENTRIES // 2):
        client.xadd(stream, {"n": str(n)})
    wait_for(lambda: _count(sessions, events) >= 50, timeout=120, what="first events")
    doomed.kill()  # SIGKILL: no cleanup, no hand-off, entries read but maybe not acknowledged
    doomed.wait()
    for n in range(ENTRIES // 2, ENTRIES):
        client.xadd(stream, {"n": str(n)})
    services.start("triggerer2", "--name", "survivor", "--heartbeat", "0.5")
    wait_for(lambda: _count(sessions, events) >= ENTRIES, timeout=300, what="all events")
    runs = select(func.count()).select_from(DagRun).where(DagRun.dag_id == "e2e_stream_consumer")
    wait_for(lambda: _count(sessions, runs) >= ENTRIES, timeout=300, what="all runs")
    assert _count_holder(sessions, held) == "survivor"
    assert _count(sessions, events) == ENTRIES
    assert _count(sessions, runs) == ENTRIES
    consumed = select(func.count(func.distinct(DagRunAssetEvent.asset_event_id)))
    assert _count(sessions, consumed) == ENTRIES
    assert _count(sessions, select(func.count()).select_from(DagRunAssetEvent)) == ENTRIES
    with sessions() as session:
        ns = sorted(int(e["fields"]["n"]) for e in session.scalars(select(AssetEventRow.extra)))
    assert ns == list(range(ENTRIES))
    wait_for(
        lambda: client.xpending(stream, "deferral")["pending"] == 0,
        timeout=60,
        what="every entry acknowledged",
    )


def _count_holder(sessions: sessionmaker[Session], statement: Any) -> Any:
    with sessions() as session:
        return session.scalar(statement)


PRODUCER = """
from deferral import DAG
from deferral.assets import Asset
from deferral.operators import PythonOperator

orders = Asset("e2e_orders")


def sources(triggering_asset_events):
    return [e.source_run_id for e in triggering_asset_events[orders]]


with DAG("e2e_producer"):
    PythonOperator(task_id="write", python_callable=lambda: 1, outlets=[orders])

with DAG("e2e_consumer", schedule=[orders]):
    PythonOperator(task_id="read", python_callable=sources)
"""


def test_a_producer_task_with_an_outlet_triggers_the_consumer_once_per_success(
    services: Services, sessions: sessionmaker[Session], write_dag: Any
) -> None:
    write_dag("e2e_assets", PRODUCER)
    services.start("scheduler")
    services.start("worker")
    for run_id in ("p1", "p2", "p3"):
        assert services.run("dags", "trigger", "e2e_producer", "--run-id", run_id).returncode == 0
    consumer_done = (
        select(func.count())
        .select_from(DagRun)
        .where(DagRun.dag_id == "e2e_consumer", DagRun.state == "success")
    )
    wait_for(lambda: _count(sessions, consumer_done) == 3, timeout=180, what="3 consumer runs")
    with sessions() as session:
        values = session.scalars(
            select(XCom.value)
            .join(TaskInstance, TaskInstance.id == XCom.task_instance_id)
            .where(TaskInstance.dag_id == "e2e_consumer", XCom.key == "return_value")
        ).all()
    assert sorted(v[0] for v in values) == ["p1", "p2", "p3"]
    all_runs = select(func.count()).select_from(DagRun).where(DagRun.dag_id == "e2e_consumer")
    assert _count(sessions, all_runs) == 3
