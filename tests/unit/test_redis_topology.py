"""Redis Cluster and Sentinel URLs, and the hash-tagged key layout (broker/DECISIONS.md)."""

from __future__ import annotations

import pytest
from redis.crc import key_slot

from broker.streams import StreamKeys, shard_of
from broker.topology import location
from deferral.runtime.config import ConfigError
from deferral.runtime.redis_urls import is_cluster_url, parse
from tests.unit.test_config import base_env, load


def test_a_cluster_url_names_its_nodes() -> None:
    where = parse("redis+cluster://:pw@10.0.0.1:7000,10.0.0.2:7001")
    assert where.kind == "cluster" and where.password == "pw"
    assert where.hosts == (("10.0.0.1", 7000), ("10.0.0.2", 7001))
    assert is_cluster_url("redis+cluster://h:1") and not is_cluster_url("redis://h:1/0")


def test_a_sentinel_url_names_its_sentinels_service_and_db() -> None:
    where = parse("redis+sentinel://s1:26379,s2:26379/mymaster/2")
    assert where.kind == "sentinel" and where.service == "mymaster" and where.db == 2
    assert where.hosts == (("s1", 26379), ("s2", 26379))


@pytest.mark.parametrize(
    ("url", "fragment"),
    [
        ("redis+cluster://", "names no host:port"),
        ("redis+cluster://h", "bad host:port 'h'"),
        ("redis+cluster://h:0", "bad host:port 'h:0'"),
        ("redis+cluster://h:99999", "bad host:port"),
        ("redis+cluster://h:1/0", "unexpected path"),
        ("redis+sentinel://s:26379", "names no service"),
        ("redis+sentinel://s:26379/svc/x", "unexpected path"),
        ("redis+cluster://" + ",".join(f"h:{p}" for p in range(1, 100)), "more than 64 hosts"),
    ],
)
def test_a_bad_cluster_or_sentinel_url_is_one_clear_line(url: str, fragment: str) -> None:
    with pytest.raises(ConfigError, match="DEFERRAL_REDIS_URL") as raised:
        load(base_env(DEFERRAL_REDIS_URL=url))
    assert fragment in str(raised.value) and "\n" not in str(raised.value)


@pytest.mark.parametrize("url", ["redis+cluster://h:7000,h:7001", "redis+sentinel://s:1/svc"])
def test_cluster_and_sentinel_urls_are_accepted(url: str) -> None:
    assert load(base_env(DEFERRAL_REDIS_URL=url)).redis_url == url


def test_one_redis_keeps_the_plain_key_names() -> None:
    keys = StreamKeys.for_redis("deferral", "redis://h:6379/0")
    assert (keys.triggers, keys.events) == ("deferral:triggers", "deferral:events")
    assert keys.inflight(keys.triggers) == "deferral:inflight:triggers"
    assert keys.queue("default") == "deferral:queue:default"
    assert keys.inflight(keys.queue("default")) == "deferral:inflight:queue:default"


def test_on_a_cluster_every_script_touches_one_slot() -> None:
    keys = StreamKeys.for_redis("deferral", "redis+cluster://h:7000")
    assert keys.triggers == "deferral:{shard:00}:triggers"
    # HAND_ON moves a trigger's entry to its event: both streams and both indexes together.
    shard = {keys.triggers, keys.events, keys.inflight(keys.triggers), keys.inflight(keys.events)}
    assert len({key_slot(k.encode()) for k in shard}) == 1
    gpu = keys.queue("gpu")
    assert gpu == "deferral:{queue:gpu}" and keys.is_queue(gpu)
    assert key_slot(gpu.encode()) == key_slot(keys.inflight(gpu).encode())
    assert keys.index_field(gpu, {"task_instance_id": "7"}) == "7"
    assert key_slot(gpu.encode()) != key_slot(keys.queue("default").encode())


@pytest.mark.parametrize(
    ("trigger_id", "shards", "shard"),
    [(1, 1, 0), (12345, 1, 0), (1, 16, 1), (16, 16, 0), (17, 16, 1), (31, 16, 15), (2**62, 7, 4)],
)
def test_a_triggers_shard_is_its_id_modulo_the_count(trigger_id: int, shards: int, shard: int):
    assert shard_of(trigger_id, shards) == shard


def test_sharded_keys_put_each_shard_in_one_slot_and_the_shards_apart() -> None:
    keys = StreamKeys.for_redis("deferral", "redis+cluster://h:7000")
    assert keys.shards == 16 and keys.triggers == "deferral:{shard:00}:triggers"
    assert keys.trigger_stream("gpu", 35) == "deferral:{shard:03}:triggers:gpu"
    assert keys.events_for(35) == "deferral:{shard:03}:events"
    for trigger_id in range(1, 40):
        triggers = keys.trigger_stream("gpu", trigger_id)
        events = keys.events_for(trigger_id)
        assert keys.events_beside(triggers) == events and keys.queue_of_triggers(triggers) == "gpu"
        together = {triggers, events, keys.inflight(triggers), keys.inflight(events)}
        assert len({key_slot(k.encode()) for k in together}) == 1
        assert keys.index_field(events, {"trigger_id": "9"}) == "9"
    assert len({key_slot(s.encode()) for s in keys.all_events}) == 16
    assert keys.triggers_of("default")[15] == "deferral:{shard:15}:triggers"
    assert not keys.is_triggers("deferral:{shard:16}:triggers") and not keys.is_triggers(
        "deferral:{shard:01}:events"
    )


def test_shards_on_one_redis_and_the_setting() -> None:
    keys = StreamKeys.for_redis("deferral", "redis://h:6379/0", 4)
    assert keys.triggers_of("default") == [f"deferral:shard:0{n}:triggers" for n in range(4)]
    assert keys.inflight(keys.events_for(6)) == "deferral:inflight:shard:02:events"
    assert keys.queue_of_triggers(keys.trigger_stream("default", 3)) == "default"
    assert load(base_env()).stream_shards == 1
    assert load(base_env(DEFERRAL_REDIS_URL="redis+cluster://h:7000")).stream_shards == 16
    assert load(base_env(DEFERRAL_STREAM_SHARDS="4")).stream_shards == 4
    with pytest.raises(ConfigError, match=r"DEFERRAL_STREAM_SHARDS is malformed: must be 1\.\.256"):
        load(base_env(DEFERRAL_STREAM_SHARDS="0"))


def test_messages_name_where_redis_is_without_credentials() -> None:
    assert location("redis+cluster://:secret@h1:7000,h2:7001") == "cluster h1:7000,h2:7001"
    where = location("redis+sentinel://u:secret@s1:26379/svc")
    assert where == "sentinel s1:26379 service svc" and "secret" not in where
    assert location("redis://:secret@h:6379/0") == "h:6379"
