"""Commands whose replies we parse ourselves, and their parsers.

The client speaks RESP2 (pinned) and redis-py's own callbacks for these commands are removed, so
reply shapes do not depend on the redis-py version or its RESP3 / legacy-response settings. This is
the one place that knows those shapes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

RAW_COMMANDS = (
    "XREADGROUP",
    "XCLAIM",
    "XPENDING",
    "XADD",
    "XRANGE",
    "XREVRANGE",
    "XINFO GROUPS",
    "XINFO CONSUMERS",
)


@dataclass(frozen=True)
class Entry:
    stream: str
    id: str
    fields: dict[bytes, bytes]

    @property
    def key(self) -> tuple[str, str]:
        """What names it: an id is unique only within its stream (shard streams filled in one
        millisecond repeat ids)."""
        return (self.stream, self.id)

    @property
    def added_at(self) -> float:
        """When Redis added it (Unix seconds): an auto-generated id starts with its milliseconds."""
        return int(self.id.partition("-")[0]) / 1000


def text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _fields(flat: list[bytes] | None) -> dict[bytes, bytes]:
    if not flat:
        return {}
    return dict(zip(flat[0::2], flat[1::2], strict=True))


def parse_xreadgroup(reply: Any) -> list[Entry]:
    """``[[stream, [[id, [f, v, ...]] | [id, nil], ...]], ...]`` or nil on timeout."""
    entries: list[Entry] = []
    for stream, items in reply or []:
        for entry_id, flat in items:
            # A nil field list is an entry deleted while still pending (re-read with id 0).
            entries.append(Entry(text(stream), text(entry_id), _fields(flat)))
    return entries


def parse_xrange(stream: str, reply: Any) -> list[Entry]:
    return [Entry(stream, text(entry_id), _fields(flat)) for entry_id, flat in reply or []]


@dataclass(frozen=True)
class PendingSummary:
    count: int
    per_consumer: dict[str, int]


def parse_xpending_summary(reply: Any) -> PendingSummary:
    """``[count, min-id, max-id, [[consumer, count], ...] | nil]``."""
    count = int(reply[0])
    consumers = {text(name): int(n) for name, n in reply[3] or []}
    return PendingSummary(count, consumers)


@dataclass(frozen=True)
class Pending:
    """One entry of a pending list."""

    id: str
    consumer: str
    idle_ms: int
    deliveries: int


def parse_xpending_extended(reply: Any) -> list[Pending]:
    """Extended XPENDING: ``[[id, consumer, idle, deliveries], ...]``."""
    return [
        Pending(text(item[0]), text(item[1]), int(item[2]), int(item[3])) for item in reply or []
    ]


def parse_xclaim(stream: str, reply: Any) -> list[Entry]:
    """``[[id, [f, v, ...]], ...]``; an entry deleted while pending is nil (Redis 6.2) or has no
    fields, and is left out: there is nothing left to run."""
    return [
        Entry(stream, text(item[0]), _fields(item[1]))
        for item in reply or []
        if item is not None and item[1]
    ]


def parse_xinfo_groups(reply: Any) -> list[dict[str, Any]]:
    groups = []
    for flat in reply or []:
        groups.append(
            {
                text(k): (text(v) if isinstance(v, bytes) else v)
                for k, v in zip(flat[0::2], flat[1::2], strict=True)
            }
        )
    return groups
