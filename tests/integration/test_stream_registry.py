"""Listing the streams (every metrics scrape does) reads a registry set of queue streams, never
a scan of the keyspace."""

from __future__ import annotations

from typing import Any

import pytest

from broker.client import Broker
from broker.streams import GROUP_WORKERS, queue_message, to_fields
from deferral.runtime.crypto import Cipher


def test_stream_stats_name_every_queue_without_scanning(
    broker: Broker, cipher: Cipher, monkeypatch: pytest.MonkeyPatch
) -> None:
    broker.publish(broker.keys.queue("q1"), queue_message(cipher, 1, 1, "d", "r", "t", -1))
    broker.ensure_group(broker.keys.queue("q2"), GROUP_WORKERS)  # a worker on an idle queue

    def no_scan(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a keyspace scan")

    for command in ("scan", "scan_iter", "keys"):
        monkeypatch.setattr(broker.redis, command, no_scan)
    keys = broker.keys
    assert broker.stream_keys() == [
        keys.triggers,
        keys.events,
        keys.dead,
        keys.queue("q1"),
        keys.queue("q2"),
    ]
    stats = {s.stream: s for s in broker.stream_stats()}
    assert stats[keys.queue("q1")].length == 1
    assert [g.name for g in stats[keys.queue("q2")].groups] == [GROUP_WORKERS]


def test_a_wiped_registry_is_named_again_by_the_next_publish(
    broker: Broker, cipher: Cipher, monkeypatch: pytest.MonkeyPatch
) -> None:
    stream = broker.keys.queue("q1")
    broker.publish(stream, queue_message(cipher, 1, 1, "d", "r", "t", -1))
    broker.redis.delete(broker.keys.queues)
    monkeypatch.setattr("broker.client.QUEUE_REGISTRY_EVERY_SEC", 0.0)
    broker.publish_many([(stream, to_fields(queue_message(cipher, 2, 1, "d", "r", "t", -1)))])
    assert stream in broker.stream_keys()
