"""``deferral streams``: the Redis streams, their consumer groups and pending entries."""

from __future__ import annotations

import click

from broker.client import Broker, RedisVersionError
from deferral.process import settings_or_exit
from deferral_cli.common import Record, emit, fail, output_options


@click.command()
@output_options
def streams(output: str) -> None:
    """Show each stream's length, its consumer groups, their lag and pending entries per consumer.

    Covers the triggers, events and dead streams and every queue stream (named in the set
    `<prefix>:queues`, never found by a keyspace scan): a row per consumer group (one row for a
    stream without a group). LAG is "-" where Redis does not report it (before Redis 7, or when
    it cannot tell). `deferral dead list` shows the dead letters themselves.
    """
    settings = settings_or_exit()
    try:
        broker = Broker.from_url(settings.redis_url, settings.stream_prefix)
    except RedisVersionError as exc:
        fail(f"Redis: {exc}")
        return
    try:
        records = stream_records(broker)
    finally:
        broker.close()
    emit(output, records, empty="no streams")


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
