"""Detects code that blocks the triggerer's event loop, and names the trigger that did it.

An async task stamps the time every ``interval``; a thread watches the stamp. When the stamp is
older than ``threshold`` the loop is stuck in one task's synchronous code: the thread notes which
asyncio task is current (triggers run in tasks named after them), and when the loop moves again
it reports that task and how long the loop was blocked.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import anyio


@dataclass
class StallTracker:
    """The pure part: fed (now, last stamp, current task name), says when a stall has ended."""

    threshold: float
    _culprit: str | None = None
    _since: float = 0.0

    def observe(
        self, now: float, last_stamp: float, current: str | None
    ) -> tuple[str, float] | None:
        stalled = now - last_stamp > self.threshold
        if stalled and self._culprit is None:
            self._culprit, self._since = current or "unknown code", last_stamp
            return None
        if not stalled and self._culprit is not None:
            culprit, blocked_for = self._culprit, last_stamp - self._since
            self._culprit = None
            return culprit, blocked_for
        return None


class LoopWatchdog:
    """Also measures the loop's lag: how much later than asked each ``interval`` sleep ends
    (``on_lag``), which every trigger's wake-ups suffer as well."""

    def __init__(
        self,
        threshold: float,
        on_block: Callable[[str, float], None],
        interval: float = 0.05,
        on_lag: Callable[[float], None] = lambda lag: None,
    ) -> None:
        self.tracker = StallTracker(threshold)
        self.on_block = on_block
        self.on_lag = on_lag
        self.interval = interval
        self.stamp = time.monotonic()
        self._stop = threading.Event()

    async def run(self) -> None:
        """Stamp the time from inside the loop, and watch it from a thread, until cancelled."""
        loop = asyncio.get_running_loop()
        thread = threading.Thread(target=self._watch, args=(loop,), daemon=True, name="watchdog")
        thread.start()
        try:
            while True:
                self.stamp = time.monotonic()
                await anyio.sleep(self.interval)
                self.on_lag(max(0.0, time.monotonic() - self.stamp - self.interval))
        finally:
            self._stop.set()

    def _watch(self, loop: asyncio.AbstractEventLoop) -> None:
        while not self._stop.wait(self.interval):
            task = asyncio.current_task(loop)  # a dict lookup; safe enough from another thread
            name = task.get_name() if task is not None else None
            report = self.tracker.observe(time.monotonic(), self.stamp, name)
            if report is not None:
                self.on_block(*report)
