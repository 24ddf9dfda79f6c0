"""The Redis streams, their consumer groups and pending entries, as ``deferral streams`` and the
web UI show them."""

from __future__ import annotations

from typing import Any

from broker.client import Broker
from deferral.runtime.crypto import Cipher
from readmodel.deadletters import newest_shown
from readmodel.records import Record


def streams_overview(broker: Broker, cipher: Cipher) -> dict[str, Any]:
    """Each stream's length, groups, pending entries and lag (as `deferral streams`), and the
    newest dead letters with how many there are."""
    return {
        "streams": stream_records(broker),
        "dead_letters": newest_shown(broker, cipher),
        "dead_letters_total": int(broker.redis.xlen(broker.keys.dead)),
    }


def stream_records(broker: Broker) -> list[Record]:
    """A record per consumer group of each stream (one for a stream without a group): the
    triggers, events and dead streams, then every queue stream named in the registry set."""
    return [row for key in broker.stream_keys() for row in _stream_records(broker, key)]


def _stream_records(broker: Broker, key: str) -> list[Record]:
    def record(
        length: int | None,
        group: str | None = None,
        pending: int | None = None,
        lag: int | None = None,
        per_consumer: dict[str, int] | None = None,
    ) -> Record:
        return {
            "stream": key,
            "exists": length is not None,
            "length": length,
            "group": group,
            "pending": pending,
            "lag": lag,
            "pending_per_consumer": per_consumer or {},
        }

    if not broker.redis.exists(key):
        return [record(None)]
    length = int(broker.redis.xlen(key))
    groups = broker.groups(key)
    if not groups:
        return [record(length)]
    records: list[Record] = []
    for group in groups:
        name = str(group["name"])
        pending = broker.pending(key, name)
        lag = group.get("lag")
        records.append(
            record(
                length,
                name,
                pending.count,
                None if lag is None else int(str(lag)),
                dict(sorted(pending.per_consumer.items())),
            )
        )
    return records
