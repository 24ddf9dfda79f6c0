"""``deferral streams``: the Redis streams, their consumer groups and pending entries."""

from __future__ import annotations

import click
from redis.exceptions import RedisError

from broker.client import Broker, RedisVersionError
from deferral.cli.common import echo_table, fail
from deferral.process import settings_or_exit


@click.command()
def streams() -> None:
    """Show each stream's length, its consumer groups, their lag and pending entries per consumer.

    Covers the triggers, events and dead streams and every queue stream under the prefix.
    LAG is "-" where Redis does not report it (before Redis 7, or when it cannot tell).
    """
    settings = settings_or_exit()
    try:
        broker = Broker.from_url(settings.redis_url, settings.stream_prefix)
    except (RedisError, RedisVersionError) as exc:
        fail(f"Redis: {exc}")
        return
    try:
        rows = [row for key in _stream_keys(broker) for row in _stream_rows(broker, key)]
    except RedisError as exc:
        fail(f"Redis: {exc}")
        return
    finally:
        broker.close()
    echo_table(("STREAM", "LENGTH", "GROUP", "PENDING", "LAG", "PENDING_PER_CONSUMER"), rows)


def _stream_keys(broker: Broker) -> list[str]:
    keys = broker.keys
    pattern = _glob_escape(keys.queue("")) + "*"
    queues = {key.decode() for key in broker.redis.scan_iter(match=pattern, _type="stream")}
    return [keys.triggers, keys.events, keys.dead, *sorted(queues)]


def _glob_escape(text: str) -> str:
    """``text`` as a literal in a Redis glob pattern (SCAN MATCH)."""
    return "".join(f"\\{ch}" if ch in "*?[]\\" else ch for ch in text)


def _stream_rows(broker: Broker, key: str) -> list[tuple[str, ...]]:
    if not broker.redis.exists(key):
        return [(key, "missing", "-", "-", "-", "-")]
    length = str(broker.redis.xlen(key))
    groups = broker.groups(key)
    if not groups:
        return [(key, length, "-", "-", "-", "-")]
    rows: list[tuple[str, ...]] = []
    for group in groups:
        name = str(group["name"])
        pending = broker.pending(key, name)
        per_consumer = " ".join(f"{c}={n}" for c, n in sorted(pending.per_consumer.items()))
        lag = group.get("lag")
        lag_text = "-" if lag is None else str(lag)
        rows.append((key, length, name, str(pending.count), lag_text, per_consumer or "-"))
    return rows
