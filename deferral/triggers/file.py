"""A trigger that waits for a file to land, and the file test it shares with FileSensor."""

from __future__ import annotations

import glob
import os
from collections.abc import AsyncIterator
from typing import Any

import anyio

from deferral.triggers.base import BaseTrigger, TriggerEvent, classpath_of


def find_file(filepath: str, recursive: bool = False) -> str | None:
    """The first file ``filepath`` (a path or a glob pattern) points at, else None.

    As in Airflow, a matching directory counts only when a file sits somewhere under it; with
    ``recursive`` a ``**`` in the pattern spans any number of directories. Blocking: call it
    off the event loop."""
    for match in sorted(glob.glob(filepath, recursive=recursive)):
        if os.path.isfile(match):
            return match
        for root, dirs, files in os.walk(match):
            dirs.sort()
            if files:
                return os.path.join(root, min(files))
    return None


class FileTrigger(BaseTrigger):
    """Fires when ``filepath`` (a path or a glob) points at a file, or at a directory holding
    one; the event payload is ``{"found": True}``. No path is in it: events are shown in the
    events stream, the logs and the UI, and a path may name what it should not (a user, a
    customer, a secret folder); the task knows the path it gave.

    ``poke_interval`` is accepted as Airflow 2.9+'s name for ``poll_interval``. File-system
    calls run in a worker thread, never on the event loop."""

    def __init__(
        self,
        filepath: str,
        poll_interval: float | None = None,
        recursive: bool = False,
        *,
        poke_interval: float | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(filepath, str) or not filepath:
            raise TypeError(f"filepath must be a non-empty str, got {filepath!r}")
        if poll_interval is not None and poke_interval is not None:
            raise TypeError("give poll_interval or its alias poke_interval, not both")
        interval = next((i for i in (poll_interval, poke_interval) if i is not None), 5.0)
        if isinstance(interval, bool) or not isinstance(interval, (int, float)):
            raise TypeError(f"poll_interval must be a number, got {type(interval).__name__}")
        if interval <= 0:
            raise ValueError("poll_interval must be greater than 0")
        if not isinstance(recursive, bool):
            raise TypeError(f"recursive must be a bool, got {type(recursive).__name__}")
        self.filepath = filepath
        self.poll_interval = interval
        self.recursive = recursive

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return classpath_of(FileTrigger), {
            "filepath": self.filepath,
            "poll_interval": self.poll_interval,
            "recursive": self.recursive,
        }

    async def run(self) -> AsyncIterator[TriggerEvent]:
        while await anyio.to_thread.run_sync(self._find) is None:
            await anyio.sleep(self.poll_interval)
        yield TriggerEvent({"found": True})

    def _find(self) -> str | None:
        return find_file(self.filepath, self.recursive)
