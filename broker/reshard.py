"""Changing a prefix's shard count (``deferral reshard-streams``, with every service stopped).

Each entry of the old triggers and events streams is moved to the stream of its trigger id's
shard under the new count: published there first (with its in-flight index field), then retired
from the old stream, so a crash half-way leaves an entry twice, never none (consumers check
PostgreSQL, and the reconciler republishes whatever PostgreSQL wants and no stream holds). An
entry already in its new stream stays; an old stream that is no new one is deleted once empty.
Wake entries are dropped (they name nothing), as are entries naming no trigger.
"""

from __future__ import annotations

from dataclasses import dataclass

from broker.client import Broker
from broker.replies import Entry
from broker.streams import GROUP_SCHEDULERS, GROUP_TRIGGERERS, StreamKeys

PAGE = 500


@dataclass(frozen=True)
class Resharded:
    moved: int
    dropped: int


def reshard(old: Broker, new: Broker) -> Resharded:
    """Move the entries of ``old``'s shard layout to ``new``'s (same Redis and prefix), then
    record ``new``'s shard count."""
    moved = dropped = 0
    streams = [(s, GROUP_TRIGGERERS) for s in old.trigger_streams()]
    streams += [(s, GROUP_SCHEDULERS) for s in old.keys.all_events]
    new_streams = set(new.trigger_streams()) | set(new.keys.all_events)
    for stream, group in streams:
        after = "-"
        while page := old.xrange(stream, PAGE, start=after):
            after = f"({page[-1].id}"
            targets = [(entry, _target(old.keys, new.keys, stream, entry)) for entry in page]
            leaving = [(entry, to) for entry, to in targets if to != stream]
            new.publish_many([(to, _text(entry)) for entry, to in leaving if to])
            old.retire(group, [entry for entry, _ in leaving])
            moved += sum(1 for _, to in leaving if to)
            dropped += sum(1 for _, to in leaving if not to)
        if stream not in new_streams:
            old.redis.delete(stream)
            old.redis.delete(old.keys.inflight(stream))
            old.redis.srem(old.keys.queues, stream)
    new.redis.set(new.keys.shard_count, new.keys.shards)
    return Resharded(moved, dropped)


def _target(old: StreamKeys, new: StreamKeys, stream: str, entry: Entry) -> str:
    """The stream ``entry`` of ``stream`` belongs in under ``new`` ('' to drop it)."""
    trigger_id = _text(entry).get("trigger_id", "")
    if not (trigger_id.isascii() and trigger_id.isdigit()):
        return ""
    if old.is_events(stream):
        return new.events_for(trigger_id)
    return new.trigger_stream(old.queue_of_triggers(stream), trigger_id)


def _text(entry: Entry) -> dict[str, str]:
    # Every field of an entry worth moving is ASCII (ids, base64); junk stays junk.
    return {k.decode(errors="replace"): v.decode(errors="replace") for k, v in entry.fields.items()}
