"""A trigger that waits for a file to appear."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from typing import Any

import anyio

from deferral.triggers.base import BaseTrigger, TriggerEvent, classpath_of


class FileTrigger(BaseTrigger):
    """Fires when ``filepath`` exists; file-system calls run off the event loop."""

    def __init__(self, filepath: str, poll_interval: float = 5.0) -> None:
        super().__init__()
        if not isinstance(filepath, str) or not filepath:
            raise TypeError(f"filepath must be a non-empty str, got {filepath!r}")
        if isinstance(poll_interval, bool) or not isinstance(poll_interval, (int, float)):
            raise TypeError(f"poll_interval must be a number, got {type(poll_interval).__name__}")
        if poll_interval <= 0:
            raise ValueError("poll_interval must be greater than 0")
        self.filepath = filepath
        self.poll_interval = poll_interval

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return classpath_of(FileTrigger), {
            "filepath": self.filepath,
            "poll_interval": self.poll_interval,
        }

    async def run(self) -> AsyncIterator[TriggerEvent]:
        while not await anyio.to_thread.run_sync(os.path.exists, self.filepath):
            await anyio.sleep(self.poll_interval)
        yield TriggerEvent({"filepath": self.filepath})
