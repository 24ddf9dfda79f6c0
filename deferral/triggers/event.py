"""Event triggers: the only triggers an ``AssetWatcher`` may run. Unlike a task's trigger, which
fires once, an event trigger yields one event per thing that happened, for as long as it runs,
each with a payload ``{"key": <dedup key>, ...}``; the triggerer records an asset event per key
(at most once) and then calls ``acknowledge``. A condition that stays true (a file that exists)
is not an event: these triggers report what is new."""

from __future__ import annotations

import fnmatch
import hashlib
import os
from collections.abc import AsyncIterator
from typing import Any

import anyio

from deferral.triggers.base import BaseTrigger, TriggerEvent, classpath_of
from deferral.triggers.http import _REQUEST_TIMEOUT_SEC, HttpTrigger, request_for, shown_url

# What one event may carry, and how many entries one read takes.
MAX_PAYLOAD_BYTES = 64 * 1024
REDIS_BATCH = 100
MAX_FILES_PER_SCAN = 10_000


class BaseEventTrigger(BaseTrigger):
    """A trigger whose every event records an asset event (Airflow 3's ``BaseEventTrigger``)."""

    async def acknowledge(self, event: TriggerEvent) -> None:
        """Called once ``event``'s asset event is committed (or was already): a source that
        redelivers until told (a stream's consumer group) is told here, never before."""


def _check_positive(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
        raise ValueError(f"{name} must be a number greater than 0, got {value!r:.40}")
    return float(value)


def _check_name(name: str, value: object) -> str:
    if not isinstance(value, str) or not value or len(value) > 250:
        raise ValueError(f"{name} must be a string of 1 to 250 characters, got {value!r:.40}")
    return value


class RedisStreamTrigger(BaseEventTrigger):
    """Reads the stream ``stream`` at ``url`` as the consumer group ``group`` (created if
    missing, from the stream's start). Each entry is an event keyed by stream and entry id;
    the entry is acknowledged (XACK) only once its asset event is committed, so a triggerer
    killed in between leaves it pending, and the watcher's next run (same consumer name) reads
    it again: the dedup key makes that one event."""

    def __init__(
        self, url: str, stream: str, group: str, consumer: str = "deferral", block_ms: int = 1000
    ) -> None:
        super().__init__()
        if not isinstance(url, str) or not url.startswith(("redis://", "rediss://", "unix://")):
            got = url.partition(":")[0] if isinstance(url, str) else type(url).__name__
            raise ValueError(f"url must be a redis://, rediss:// or unix:// URL, got {got[:20]}")
        self.url = url
        self.stream = _check_name("stream", stream)
        self.group = _check_name("group", group)
        self.consumer = _check_name("consumer", consumer)
        self.block_ms = int(_check_positive("block_ms", block_ms))
        self._client: Any = None

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return classpath_of(RedisStreamTrigger), {
            "url": self.url,
            "stream": self.stream,
            "group": self.group,
            "consumer": self.consumer,
            "block_ms": self.block_ms,
        }

    async def run(self) -> AsyncIterator[TriggerEvent]:
        import redis.asyncio as aioredis
        from redis.exceptions import ResponseError

        self._client = client = aioredis.Redis.from_url(self.url, decode_responses=False)
        try:
            try:
                await client.xgroup_create(self.stream, self.group, id="0", mkstream=True)
            except ResponseError as exc:
                if "BUSYGROUP" not in str(exc):
                    raise
            # First what this consumer read but never acknowledged (a killed run), then new.
            cursor: bytes | str = b"0"
            while True:
                reply: Any = await client.xreadgroup(
                    self.group,
                    self.consumer,
                    {self.stream: cursor},
                    count=REDIS_BATCH,
                    block=None if cursor != ">" else self.block_ms,
                )
                entries = reply[0][1] if reply else []
                if cursor != ">" and not entries:
                    cursor = ">"
                    continue
                for entry_id, fields in entries:
                    if cursor != ">":
                        cursor = entry_id
                    yield TriggerEvent(self._payload(entry_id, fields))
        finally:
            self._client = None
            await client.aclose()

    def _payload(self, entry_id: bytes, fields: dict[bytes, bytes]) -> dict[str, Any]:
        ident = entry_id.decode()
        decoded = {
            k.decode("utf-8", "replace"): v.decode("utf-8", "replace") for k, v in fields.items()
        }
        size = sum(len(k) + len(v) for k, v in decoded.items())
        if size > MAX_PAYLOAD_BYTES:
            # Recorded, not dropped: the run learns the entry was too big to carry.
            decoded = {"error": f"entry of {size} bytes is over {MAX_PAYLOAD_BYTES}"}
        return {
            "key": f"{self.stream}:{ident}",
            "stream": self.stream,
            "id": ident,
            "fields": decoded,
        }

    async def acknowledge(self, event: TriggerEvent) -> None:
        if self._client is not None:
            await self._client.xack(self.stream, self.group, event.payload["id"])


class DirectoryWatchTrigger(BaseEventTrigger):
    """An event per file matching ``pattern`` in ``directory`` (not recursive), keyed by path,
    size and modification time: a new file, or one written again, is an event once. Files there
    when the watcher first starts are events too (once: the keys are remembered in PostgreSQL)."""

    def __init__(self, directory: str, pattern: str = "*", poll_interval: float = 5.0) -> None:
        super().__init__()
        if not isinstance(directory, str) or not os.path.isabs(directory):
            raise ValueError(f"directory must be an absolute path, got {directory!r:.80}")
        self.directory = directory
        self.pattern = _check_name("pattern", pattern)
        self.poll_interval = _check_positive("poll_interval", poll_interval)

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return classpath_of(DirectoryWatchTrigger), {
            "directory": self.directory,
            "pattern": self.pattern,
            "poll_interval": self.poll_interval,
        }

    def _scan(self) -> list[tuple[str, int, int]]:
        found: list[tuple[str, int, int]] = []
        try:
            entries = os.scandir(self.directory)
        except OSError:
            return found
        with entries:
            for entry in entries:
                if len(found) >= MAX_FILES_PER_SCAN:
                    break
                if fnmatch.fnmatch(entry.name, self.pattern) and entry.is_file():
                    stat = entry.stat()
                    found.append((entry.path, stat.st_size, stat.st_mtime_ns))
        return sorted(found)

    async def run(self) -> AsyncIterator[TriggerEvent]:
        seen: set[tuple[str, int, int]] = set()
        while True:
            for path, size, mtime_ns in await anyio.to_thread.run_sync(self._scan):
                if (path, size, mtime_ns) not in seen:
                    seen.add((path, size, mtime_ns))
                    yield TriggerEvent(
                        {"key": f"{path}:{size}:{mtime_ns}"[-250:], "path": path, "size": size}
                    )
            await anyio.sleep(self.poll_interval)


def _body_digest(url: str) -> tuple[int, str] | None:
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(request_for(url), timeout=_REQUEST_TIMEOUT_SEC) as response:
            body = response.read(MAX_PAYLOAD_BYTES + 1)
            return int(response.status), hashlib.sha256(body).hexdigest()
    except (urllib.error.URLError, OSError):
        return None


class HttpPollTrigger(BaseEventTrigger):
    """Polls GET ``url`` every ``poll_interval`` seconds: an event each time a 2xx answer's body
    differs from the last one seen, keyed by the body's SHA-256 (the same body twice is one
    event)."""

    def __init__(self, url: str, poll_interval: float = 30.0) -> None:
        super().__init__()
        HttpTrigger(url, poll_interval=_check_positive("poll_interval", poll_interval))
        self.url = url
        self.poll_interval = float(poll_interval)

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return classpath_of(HttpPollTrigger), {"url": self.url, "poll_interval": self.poll_interval}

    async def run(self) -> AsyncIterator[TriggerEvent]:
        last: str | None = None
        while True:
            got = await anyio.to_thread.run_sync(_body_digest, self.url)
            if got is not None and 200 <= got[0] < 300 and got[1] != last:
                last = got[1]
                yield TriggerEvent(
                    {"key": f"{shown_url(self.url)[:170]}#{last}", "url": shown_url(self.url)}
                )
            await anyio.sleep(self.poll_interval)
