"""A trigger that waits for a file to land, and the file test it shares with FileSensor; the
asset watchers' triggers that consume a file (delete it once its event is recorded)."""

from __future__ import annotations

import contextlib
import glob
import os
from collections.abc import AsyncIterator
from typing import Any

import anyio

from deferral.triggers.base import BaseTrigger, TriggerEvent, classpath_of
from deferral.triggers.event import BaseEventTrigger


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


class FileDeleteTrigger(BaseEventTrigger):
    """An ``AssetWatcher``'s trigger (Airflow 3's): an event each time the file ``filepath``
    appears, keyed by its path, inode, size and modification time; the file is deleted once its
    asset event is committed (``acknowledge``), so a triggerer that dies in between finds it
    again and the key makes that the same event. A file rewritten before it is deleted is kept
    for its own event."""

    def __init__(self, filepath: str, poke_interval: float = 5.0) -> None:
        super().__init__()
        if not isinstance(filepath, str) or not os.path.isabs(filepath):
            raise ValueError(f"filepath must be an absolute path, got {filepath!r:.80}")
        if isinstance(poke_interval, bool) or not isinstance(poke_interval, int | float):
            raise ValueError(f"poke_interval must be a number, got {poke_interval!r:.40}")
        if poke_interval <= 0:
            raise ValueError(f"poke_interval must be greater than 0, got {poke_interval!r}")
        self.filepath = filepath
        self.poke_interval = float(poke_interval)

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return classpath_of(FileDeleteTrigger), {
            "filepath": self.filepath,
            "poke_interval": self.poke_interval,
        }

    async def run(self) -> AsyncIterator[TriggerEvent]:
        while True:
            key = await anyio.to_thread.run_sync(_file_key, self.filepath)
            if key is not None:
                yield TriggerEvent({"key": key, "path": self.filepath})
            await anyio.sleep(self.poke_interval)

    async def acknowledge(self, event: TriggerEvent) -> None:
        await anyio.to_thread.run_sync(_delete_if_same, event.payload["path"], event.payload["key"])


class DirectoryFileDeleteTrigger(FileDeleteTrigger):
    """``FileDeleteTrigger`` for the file ``filename`` in ``directory`` (Airflow 3.3's name for
    watchers of flag files landing in one inbox directory)."""

    def __init__(self, *, directory: str, filename: str, poke_interval: float = 5.0) -> None:
        if not isinstance(filename, str) or not filename or os.sep in filename:
            raise ValueError(f"filename must be a file name with no {os.sep}, got {filename!r:.80}")
        if not isinstance(directory, str):
            raise ValueError(f"directory must be an absolute path, got {directory!r:.80}")
        super().__init__(os.path.join(directory, filename), poke_interval)
        self.directory, self.filename = directory, filename

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return classpath_of(DirectoryFileDeleteTrigger), {
            "directory": self.directory,
            "filename": self.filename,
            "poke_interval": self.poke_interval,
        }


def _file_key(path: str) -> str | None:
    """What tells this file from the one there before it, or None if there is no file."""
    try:
        stat = os.stat(path)
    except OSError:
        return None
    if not os.path.isfile(path):
        return None
    return f"{path}:{stat.st_ino}:{stat.st_size}:{stat.st_mtime_ns}"[-250:]


def _delete_if_same(path: str, key: str) -> None:
    if _file_key(path) == key:
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)
