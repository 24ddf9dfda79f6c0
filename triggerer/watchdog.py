"""Detects code that stalls the triggerer's event loop, and names the trigger that did it.

An async task stamps the time every ``interval``; a thread watches the stamp. When the stamp is
older than ``threshold`` the loop is stuck in one task's synchronous code: the thread asks the
service who that task is (``identify``: triggers are known by their asyncio task), samples the
loop thread's stack at once (``sys._current_frames``: where the blocking call sits, while it
still sits there) and reports the stall; when the loop moves again it reports how long it was
held.
"""

from __future__ import annotations

import asyncio
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

import anyio

C = TypeVar("C")

# Innermost frames of a sampled stack that a report keeps (the blocking call is the last one).
STACK_FRAMES = 30


@dataclass(frozen=True)
class StallStarted(Generic[C]):
    """The loop has not moved for longer than the threshold; ``culprit`` was running."""

    culprit: C | None
    since: float  # monotonic time of the last stamp


@dataclass(frozen=True)
class StallEnded(Generic[C]):
    culprit: C | None
    seconds: float


@dataclass
class StallTracker(Generic[C]):
    """The pure part: fed (now, last stamp, who is current), says when a stall starts and ends."""

    threshold: float
    _stalled: bool = False
    _culprit: C | None = None
    _since: float = 0.0

    def observe(
        self, now: float, last_stamp: float, current: C | None
    ) -> StallStarted[C] | StallEnded[C] | None:
        stalled = now - last_stamp > self.threshold
        if stalled and not self._stalled:
            self._stalled, self._culprit, self._since = True, current, last_stamp
            return StallStarted(current, last_stamp)
        if not stalled and self._stalled:
            ended = StallEnded(self._culprit, last_stamp - self._since)
            self._stalled, self._culprit = False, None
            return ended
        return None


def sample_stack(thread_id: int, frames: int = STACK_FRAMES) -> str:
    """The current stack of thread ``thread_id``, innermost frame last ('' if it has ended)."""
    frame = sys._current_frames().get(thread_id)
    if frame is None:
        return ""
    return "".join(traceback.format_stack(frame)[-frames:]).rstrip()


class LoopWatchdog(Generic[C]):
    """Also measures the loop's lag: how much later than asked each ``interval`` sleep ends
    (``on_lag``), which every trigger's wake-ups suffer as well."""

    def __init__(
        self,
        threshold: float,
        identify: Callable[[asyncio.Task[object] | None], C | None],
        on_stall: Callable[[C | None, str], None],
        on_block: Callable[[C | None, float], None],
        interval: float = 0.05,
        on_lag: Callable[[float], None] = lambda lag: None,
    ) -> None:
        self.tracker: StallTracker[C] = StallTracker(threshold)
        self.identify = identify
        self.on_stall = on_stall
        self.on_block = on_block
        self.on_lag = on_lag
        self.interval = interval
        self.stamp = time.monotonic()
        self._stop = threading.Event()

    async def run(self) -> None:
        """Stamp the time from inside the loop, and watch it from a thread, until cancelled."""
        loop = asyncio.get_running_loop()
        thread = threading.Thread(
            target=self._watch, args=(loop, threading.get_ident()), daemon=True, name="watchdog"
        )
        thread.start()
        try:
            while True:
                self.stamp = time.monotonic()
                await anyio.sleep(self.interval)
                self.on_lag(max(0.0, time.monotonic() - self.stamp - self.interval))
        finally:
            self._stop.set()

    def _watch(self, loop: asyncio.AbstractEventLoop, loop_thread: int) -> None:
        while not self._stop.wait(self.interval):
            # Reads of the loop's current task and the service's table: dict lookups, safe
            # enough from another thread (the loop is stuck anyway when it matters).
            current = self.identify(asyncio.current_task(loop))
            report = self.tracker.observe(time.monotonic(), self.stamp, current)
            if isinstance(report, StallStarted):
                self.on_stall(report.culprit, sample_stack(loop_thread))
            elif isinstance(report, StallEnded):
                self.on_block(report.culprit, report.seconds)
