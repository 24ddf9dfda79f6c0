"""The services on a real Redis Cluster of 3 primaries and 3 replicas on loopback ports
(``redis-server --cluster-enabled yes``, ``redis-cli --cluster create --cluster-replicas 1``),
started for this module and stopped after it.

The end-to-end defer -> trigger -> resume test, the kill -9 takeover test and the Redis-wipe
repair test run here unchanged (this module's ``redis_url`` fixture overrides the session's);
then 500 deferred tasks finish exactly once although the primary holding shard 0 of the triggers
and events streams is killed (kill -9) mid-run and its replica promoted. The streams are in
DEFERRAL_STREAM_SHARDS = 16 shards (a cluster's default), found on every primary afterwards. No
service may log ``CROSSSLOT``.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from redis.exceptions import RedisError
from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

from broker.client import Broker, ShardCountError
from broker.reshard import Resharded, reshard
from broker.streams import GROUP_WORKERS, WAKE
from deferral.runtime.crypto import Cipher
from deferral.store.tables import TaskInstance, TaskStateChange
from tests.e2e.conftest import Services
from tests.e2e.test_defer_resume import (
    test_task_defers_frees_its_slot_and_resumes_on_a_fresh_instance as test_defer_resume_on_cluster,
)
from tests.e2e.test_redis_wipe_under_churn import DAG as GATED_DAG
from tests.e2e.test_redis_wipe_under_churn import _counts
from tests.e2e.test_redis_wipe_under_churn import (
    test_every_key_wiped_under_churn as test_wipe_repair_on_cluster,
)
from tests.e2e.test_triggerer_leases import (
    test_a_killed_triggerers_trigger_is_taken_over_and_fires_once as test_takeover_on_cluster,
)
from tests.helpers import wait_for
from tests.redis_topologies import LocalCluster, redis_binaries_found, running

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(not redis_binaries_found(), reason="redis-server/redis-cli not found"),
]

__all__ = [
    "test_defer_resume_on_cluster",
    "test_takeover_on_cluster",
    "test_wipe_repair_on_cluster",
]

N = 500


@pytest.fixture(scope="module")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    yield from running(LocalCluster(tmp_path_factory.mktemp("cluster")))


@pytest.fixture(scope="module")
def redis_url(redis_cluster: LocalCluster) -> str:
    return redis_cluster.url


@pytest.fixture(autouse=True)
def _no_crossslot(services: Services) -> Iterator[None]:
    """After each test here: no service logged a CROSSSLOT error (a script or command whose
    keys are in different slots)."""
    yield
    for name in services.procs:
        assert "CROSSSLOT" not in services.log(name), name


def test_a_primary_killed_mid_run_loses_no_task_and_runs_none_twice(
    redis_cluster: LocalCluster,
    services: Services,
    write_dag: Any,
    sessions: sessionmaker[Session],
    broker: Broker,
    tmp_path: Path,
) -> None:
    gate = tmp_path / "gate"
    write_dag(
        "e2e_cluster_dag", GATED_DAG.replace("e2e_wipe", "e2e_cluster").format(gate=str(gate), n=N)
    )
    for name in ("scheduler", "worker", "triggerer"):
        services.start(name, *(("--concurrency", "4") if name == "worker" else ()))
    assert services.run("dags", "trigger", "e2e_cluster").returncode == 0
    wait_for(
        lambda: _counts(sessions).get("deferred", 0) >= N // 2, timeout=300, what="half deferred"
    )

    # The primary of the triggers and events streams dies mid-run (replication is
    # asynchronous: its last writes may be lost with it); its replica takes over.
    cluster: Any = broker.redis
    victim_node = cluster.get_node_from_key(broker.keys.triggers)
    victim = int(victim_node.port)
    # This client's default node (the one redis-py asks about commands) is the victim.
    assert cluster.set_default_node(victim_node)
    redis_cluster.kill_primary(victim)
    gate.write_text("open")

    # A read of a stream on a live primary works again once the cluster has settled, although
    # the client's default node died (redis-py asked that node for XREADGROUP's keys, outside its
    # retry, so the worker's reads failed until it was restarted).
    queue = broker.keys.queue("default")
    assert int(cluster.get_node_from_key(queue).port) != victim

    def reads() -> bool:
        try:
            broker.read(GROUP_WORKERS, "default-node-probe", {queue: "0"}, count=1)
        except RedisError:
            return False
        return True

    wait_for(reads, timeout=60, what="a read after the default node died")

    wait_for(lambda: _counts(sessions) == {"success": N}, timeout=600, what=f"all {N} to succeed")
    with sessions() as session:
        successes = session.execute(
            select(func.count())
            .select_from(TaskStateChange)
            .join(TaskInstance, TaskStateChange.task_instance_id == TaskInstance.id)
            .where(TaskStateChange.to_state == "success")
        ).scalar_one()
    assert successes == N
    assert victim not in redis_cluster.primaries()
    # 16 shards spread the trigger and event streams (left with their groups) over every primary.
    found = redis_cluster.keys(f"{broker.keys.prefix}*")
    assert len(found) == 3
    for port, keys in found.items():
        assert any(":{shard:" in key for key in keys), (port, keys)


def test_dead_letters_and_redrives_split_around_the_dead_letter_slot(
    broker: Broker, cipher: Cipher
) -> None:
    """On a cluster ``deferral:dead`` has a slot of its own: a dead letter is written, then its
    entry retired; a re-drive publishes once, refuses while the work is in flight, and deletes
    the dead letter."""
    queue = broker.keys.queue("default")
    broker.ensure_group(queue, GROUP_WORKERS)
    fields = {"task_instance_id": "7", "try_number": "1", "task": "d.r.t", "mac": "m"}
    broker.publish_many([(queue, fields), (broker.keys.triggers, {"trigger_id": "5"})])
    [entry] = broker.read(GROUP_WORKERS, "w1", {queue: ">"}, count=1)
    broker.dead_letter(entry, GROUP_WORKERS, "bad entry", cipher=cipher, consumer="w1")
    assert broker.present(queue, ["7"]) == {"7": False}
    assert broker.pending(queue, GROUP_WORKERS).count == 0
    [dead] = broker.newest(broker.keys.dead)

    first = broker.redrive_dead(dead.id, queue, fields)
    assert first.status == 1 and broker.present(queue, ["7"]) == {"7": True}
    assert broker.redrive_dead(dead.id, queue, fields).status == 0  # deleted with the re-drive
    [again] = broker.read(GROUP_WORKERS, "w1", {queue: ">"}, count=1)
    broker.dead_letter(again, GROUP_WORKERS, "bad entry", cipher=cipher, consumer="w1")
    [second] = broker.newest(broker.keys.dead)
    broker.publish(queue, fields)  # the reconciler's republish: the work is in flight
    refused = broker.redrive_dead(second.id, queue, fields)
    assert refused.status == -1 and broker.newest(broker.keys.dead)[0].id == second.id


def test_the_cli_reaches_the_cluster(services: Services, broker: Broker) -> None:
    """``deferral health`` pings the cluster and ``deferral streams`` lists its streams."""
    broker.ensure_group(broker.keys.triggers, "triggerers")
    health = services.run("health")
    assert health.returncode == 0 and "redis: answers at cluster 127.0.0.1:" in health.stdout
    streams = services.run("streams")
    assert streams.returncode == 0 and broker.keys.triggers in streams.stdout, streams


def test_a_reshard_moves_every_entry_to_its_shard_in_one_slot_each(
    redis_cluster: LocalCluster, broker: Broker
) -> None:
    """``reshard`` from 16 shards to 4 (a prefix of its own: the services' keeps 16): each
    trigger and event entry lands in its trigger id's new shard, wake entries are dropped,
    and the new count is recorded; the old count is then refused."""
    prefix = f"{broker.keys.prefix}-reshard"
    old = Broker.from_url(redis_cluster.url, prefix, shards=16)
    new = Broker.from_url(redis_cluster.url, prefix, shards=4, check_shards=False)
    try:
        trigger_ids = range(1, 41)
        old.publish_many(
            [(old.keys.trigger_stream("gpu", t), {"trigger_id": str(t)}) for t in trigger_ids]
            + [(old.keys.events_for(t), {"trigger_id": str(t)}) for t in trigger_ids]
            + [(old.keys.events, WAKE)]
        )
        # Those whose shard number is the same under 4 (t % 16 < 4: 11 of 40 in each kind of
        # stream) stay where they are.
        assert reshard(old, new) == Resharded(moved=80 - 2 * 11, dropped=1)
        for shard in range(4):
            want = {str(t) for t in trigger_ids if t % 4 == shard}
            for stream in (new.keys.triggers_for("gpu", shard), new.keys.all_events[shard]):
                entries = new.xrange(stream)
                assert {e.fields[b"trigger_id"].decode() for e in entries} == want, stream
                assert all(new.present(stream, sorted(want)).values())
        assert not any(old.redis.exists(s) for s in old.keys.triggers_of("gpu")[4:])
        assert new.recorded_shards() == 4
        with pytest.raises(ShardCountError, match=r"DEFERRAL_STREAM_SHARDS is 16 .* with 4"):
            Broker.from_url(redis_cluster.url, prefix, shards=16)
    finally:
        old.close()
        new.close()
