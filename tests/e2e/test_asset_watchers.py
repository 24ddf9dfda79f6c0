"""Assets through real processes: a producer's outlet makes one consumer run per success, whose
task reads its triggering_asset_events; a RedisStreamTrigger watcher turns 1,000 XADDs into
1,000 asset events and 1,000 asset-triggered runs, none twice, across a kill -9 of the triggerer
running it (a peer takes its lease over; entries read but not acknowledged are read again and
deduplicated); every entry ends acknowledged."""

from __future__ import annotations

import time
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
from deferral_cli.embedded import free_port
from tests.e2e.conftest import Services
from tests.e2e.test_metrics import scrape, value
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


HOSTILE_DAG = """
from deferral import DAG
from deferral.assets import Asset, AssetWatcher
from deferral.operators import EmptyOperator
from deferral.triggers.event import RedisStreamTrigger

source = RedisStreamTrigger({url!r}, {stream!r}, "deferral", block_ms=200)
watched = Asset({asset!r}, watchers=[AssetWatcher("redis", source)])

with DAG({dag_id!r}, schedule=[watched], max_active_runs={runs}) as dag:
    {tasks}
"""


def _hostile_dag(stream: str, dag_id: str, runs: int, tasks: str = "pass") -> str:
    return HOSTILE_DAG.format(
        url=REDIS_URL, stream=stream, asset=f"{dag_id}_asset", dag_id=dag_id, runs=runs, tasks=tasks
    )


def test_nul_and_bytes_that_are_not_utf8_on_a_watched_stream_are_recorded_and_so_is_the_rest(
    services: Services, sessions: sessionmaker[Session], write_dag: Any, stream_prefix: str
) -> None:
    stream = f"{stream_prefix}:hostile:{uuid.uuid4().hex[:6]}"
    write_dag("e2e_hostile_stream", _hostile_dag(stream, "e2e_hostile_stream", 5000))
    client = redis.Redis.from_url(REDIS_URL)
    services.start("scheduler")
    services.start("triggerer", "--name", "watching", "--heartbeat", "0.5")
    held = select(AssetWatcherRow.triggerer_id)
    wait_for(lambda: _count_holder(sessions, held) == "watching", timeout=120, what="the lease")
    hostile: list[dict[Any, Any]] = [
        {"n": b"a\x00b"},
        {b"k\x00": b"v"},
        {"n": b"\xed\xa0\x80"},  # a lone surrogate as WTF-8 bytes: not UTF-8
        {"n": b"\xff\xfe\x00"},
    ]
    for fields in hostile:
        client.xadd(stream, fields)
    for n in range(20):
        client.xadd(stream, {"n": str(n)})
    events = select(func.count()).select_from(AssetEventRow)
    wait_for(lambda: _count(sessions, events) >= 24, timeout=120, what="every entry recorded")
    with sessions() as session:
        fields = [e["fields"] for e in session.scalars(select(AssetEventRow.extra))]
    assert {"n": "a\\x00b"} in fields and {"k\\x00": "v"} in fields
    assert {"n": "\ufffd\ufffd\ufffd"} in fields and {"n": "\ufffd\ufffd\\x00"} in fields
    assert sorted(int(f["n"]) for f in fields if f.get("n", "").isdigit()) == list(range(20))
    wait_for(
        lambda: client.xpending(stream, "deferral")["pending"] == 0,
        timeout=60,
        what="every entry acknowledged",
    )
    log = services.log("triggerer")
    assert "ExceptionGroup" not in log and "could not be recorded" not in log


FLOOD = 1000
BOUND = 100


def test_a_flood_of_1000_entries_stops_at_the_watchers_bound_with_the_metric_raised(
    services: Services, sessions: sessionmaker[Session], write_dag: Any, stream_prefix: str
) -> None:
    stream = f"{stream_prefix}:flood:{uuid.uuid4().hex[:6]}"
    # One run at a time and no worker: its run never ends, the other events wait for theirs.
    write_dag("e2e_flooded", _hostile_dag(stream, "e2e_flooded", 1, 'EmptyOperator(task_id="t")'))
    client = redis.Redis.from_url(REDIS_URL)
    port = free_port()
    services.start("scheduler")
    services.start(
        "triggerer",
        "--name",
        "flooded",
        "--heartbeat",
        "0.5",
        "--metrics-port",
        str(port),
        env={"DEFERRAL_ASSET_WATCHER_MAX_QUEUED": str(BOUND)},
    )
    held = select(AssetWatcherRow.triggerer_id)
    wait_for(lambda: _count_holder(sessions, held) == "flooded", timeout=120, what="the lease")
    for n in range(FLOOD):
        client.xadd(stream, {"n": str(n)})
    metric = "deferral_asset_watcher_bound_reached_total"
    wait_for(lambda: value(scrape(port), metric) >= 1, timeout=120, what="the bound reached")
    events = select(func.count()).select_from(AssetEventRow)
    runs = select(func.count()).select_from(DagRun).where(DagRun.dag_id == "e2e_flooded")
    # The bound counts events waiting for a run; the one run that started holds one more (the
    # watcher reads it once that run exists, which may come after the bound was first reached).
    wait_for(lambda: _count(sessions, runs) == 1, timeout=120, what="the one run")
    recorded = BOUND + 1
    wait_for(lambda: _count(sessions, events) == recorded, timeout=60, what="the bound's events")
    deadline = time.monotonic() + 3  # six heartbeats at the bound: nothing more comes in
    while time.monotonic() < deadline:
        assert _count(sessions, events) == recorded
        time.sleep(0.25)
    # Counted each time the bound is reached again (the run that started freed a place).
    assert value(scrape(port), metric) >= 1
    assert _count(sessions, runs) == 1
    paused = [line for line in services.log("triggerer").splitlines() if "reading paused" in line]
    assert len(paused) == 1 and f"{BOUND} of its events wait for their runs" in paused[0]
    # What was not recorded waits in the stream, unacknowledged.
    assert client.xlen(stream) == FLOOD
    assert client.xpending(stream, "deferral")["pending"] <= FLOOD - recorded
