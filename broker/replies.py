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
    "XAUTOCLAIM",
    "XCLAIM",
    "XPENDING",
    "XADD",
    "XRANGE",
    "XREVRANGE",
    "XINFO GROUPS",
)


@dataclass(frozen=True)
class Entry:
    stream: str
    id: str
    fields: dict[bytes, bytes]


def _text(value: bytes | str) -> str:
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
            entries.append(Entry(_text(stream), _text(entry_id), _fields(flat)))
    return entries


@dataclass(frozen=True)
class AutoclaimResult:
    cursor: str
    entries: list[Entry]
    deleted_ids: list[str]


def parse_xautoclaim(stream: str, reply: Any) -> AutoclaimResult:
    """Redis 7: ``[cursor, [[id, fields]...], [deleted ids]]``; 6.2: no third element and
    deleted entries come back as nil pairs."""
    cursor, claimed = reply[0], reply[1]
    deleted = [_text(i) for i in reply[2]] if len(reply) > 2 else []
    entries: list[Entry] = []
    for item in claimed:
        if item is None:
            continue
        entry_id, flat = item
        if flat is None:
            deleted.append(_text(entry_id))
        else:
            entries.append(Entry(stream, _text(entry_id), _fields(flat)))
    return AutoclaimResult(_text(cursor), entries, deleted)


def parse_xrange(stream: str, reply: Any) -> list[Entry]:
    return [Entry(stream, _text(entry_id), _fields(flat)) for entry_id, flat in reply or []]


@dataclass(frozen=True)
class PendingSummary:
    count: int
    per_consumer: dict[str, int]


def parse_xpending_summary(reply: Any) -> PendingSummary:
    """``[count, min-id, max-id, [[consumer, count], ...] | nil]``."""
    count = int(reply[0])
    consumers = {_text(name): int(n) for name, n in reply[3] or []}
    return PendingSummary(count, consumers)


def parse_ids(reply: Any) -> list[str]:
    """A list of entry ids (XCLAIM ... JUSTID, the renewal script)."""
    return [_text(i) for i in reply or []]


def parse_xpending_ids(reply: Any) -> list[str]:
    """Extended XPENDING: ``[[id, consumer, idle, deliveries], ...]``."""
    return [_text(item[0]) for item in reply or []]


def parse_xpending_owners(reply: Any) -> dict[str, str]:
    """Extended XPENDING: entry id -> the consumer that holds it."""
    return {_text(item[0]): _text(item[1]) for item in reply or []}


def parse_xclaim(stream: str, reply: Any) -> list[Entry]:
    """``[[id, [f, v, ...]], ...]``; an entry deleted while pending is nil (Redis 6.2) or has no
    fields, and is left out: there is nothing left to run."""
    return [
        Entry(stream, _text(item[0]), _fields(item[1]))
        for item in reply or []
        if item is not None and item[1]
    ]


def parse_xinfo_groups(reply: Any) -> list[dict[str, Any]]:
    groups = []
    for flat in reply or []:
        groups.append(
            {
                _text(k): (_text(v) if isinstance(v, bytes) else v)
                for k, v in zip(flat[0::2], flat[1::2], strict=True)
            }
        )
    return groups
