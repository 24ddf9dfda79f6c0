"""The triggers that only wait for a moment (a timer runs no code of its own), on one shared
timer: fired as their moments come, many due at once a batch at a time."""

from __future__ import annotations

import datetime as dt
import heapq
import itertools
from collections.abc import Callable

import anyio
import anyio.lowlevel

from deferral.runtime import clock
from triggerer.held import Held

# How close to a timer's moment the loop polls for it instead of sleeping (a sleep ends up to a
# millisecond late).
TIMER_SPIN_SEC = 0.0015
# Timers fired before the publisher may run (10,000 due at once would otherwise all be fired,
# logged and signed before the first is published).
FIRE_BATCH = 250


class Timers:
    """Triggers that only wait for a moment, on one shared timer: a heap of (moment, held)."""

    def __init__(self) -> None:
        self._heap: list[tuple[dt.datetime, int, Held]] = []
        self._order = itertools.count()  # ties broken by arrival, never by comparing Helds
        self._changed = anyio.Event()

    def add(self, held: Held) -> None:
        assert held.moment is not None
        earliest = not self._heap or held.moment < self._heap[0][0]
        heapq.heappush(self._heap, (held.moment, next(self._order), held))
        if earliest:
            self._changed.set()

    async def run(self, fire: Callable[[Held], None]) -> None:
        """Fire every held timer whose moment has come, as it comes; many due at once are fired
        FIRE_BATCH at a time, the publisher sending each batch while the next is fired."""
        while True:
            now = clock.now()  # the database's time: moments are by its clock
            fired = 0
            while self._heap and self._heap[0][0] <= now:
                fire(heapq.heappop(self._heap)[2])
                fired += 1
                if fired % FIRE_BATCH == 0:
                    await anyio.lowlevel.checkpoint()
            wait = (self._heap[0][0] - now).total_seconds() if self._heap else 60.0
            if wait <= TIMER_SPIN_SEC:
                # The loop's sleeps end on the next whole millisecond: the last one is polled.
                await anyio.lowlevel.checkpoint()
                continue
            # Wake for the next moment, a newer earlier one, or at least every minute (a clock
            # step must not stretch a wait).
            self._changed = anyio.Event()
            with anyio.move_on_after(min(wait - TIMER_SPIN_SEC, 60.0)):
                await self._changed.wait()
