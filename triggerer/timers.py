"""The triggers that only wait for a moment (a timer runs no code of its own), on one shared
timer: each event sealed shortly before its moment, fired as the moment comes, many due at once
a batch at a time."""

from __future__ import annotations

import datetime as dt
import heapq
from collections.abc import Callable

import anyio
import anyio.lowlevel

from deferral.runtime import clock
from triggerer.held import Held
from triggerer.holding import BUCKET, DOZE_AHEAD, HeldTriggers

# How close to a timer's moment the loop polls for it instead of sleeping (a sleep ends up to a
# millisecond late).
TIMER_SPIN_SEC = 0.0015
# Timers fired (or sealed) before the publisher may run (10,000 due at once would otherwise all
# be fired, logged and signed before the first is published).
FIRE_BATCH = 250
# How long before its moment a timer's event is sealed (``prepare``): at the moment it is only
# logged and published, and a timer due later keeps no sealed event (memory per timer held).
SEAL_AHEAD = dt.timedelta(seconds=5)


def _unprepared(_: Held) -> None:
    return None


def _moment(held: Held) -> dt.datetime:
    assert held.moment is not None  # a timer's (Timers.add)
    return held.moment


class Timers:
    """Triggers that only wait for a moment, on one shared timer: a heap of those due later,
    and one of those due within SEAL_AHEAD, their events sealed. The heaps hold the Helds
    themselves, ordered by moment then trigger id (``Held.__lt__``): no tuple or counter kept
    per timer. With the triggers ``held``, a timer due later than DOZE_AHEAD dozes in its columns
    (``HeldTriggers.doze``) until then."""

    def __init__(self, held: HeldTriggers | None = None) -> None:
        self._later: list[Held] = []
        self._soon: list[Held] = []
        self._changed = anyio.Event()
        self._held = held
        if held is not None:
            held.schedule = self._schedule

    def __len__(self) -> int:
        return len(self._later) + len(self._soon) + (len(self._held.far) if self._held else 0)

    def add(self, held: Held) -> None:
        assert held.moment is not None
        if self._held is not None and held.moment > clock.now() + DOZE_AHEAD + BUCKET:
            woke = self._held.far.next_wake()
            if self._held.doze(held):
                if woke != self._held.far.next_wake():  # an earlier bucket: wake for it
                    self._changed.set()
                return
        self._schedule(held)

    def _schedule(self, held: Held) -> None:
        earliest = not self._later or held < self._later[0]
        heapq.heappush(self._later, held)
        if earliest:
            self._changed.set()

    async def run(
        self, fire: Callable[[Held], None], prepare: Callable[[Held], None] = _unprepared
    ) -> None:
        """Fire every held timer whose moment has come, as it comes, its event prepared
        (``prepare``) SEAL_AHEAD before; many due at once are prepared and fired FIRE_BATCH at
        a time, the publisher sending each batch while the next is fired."""
        while True:
            now = clock.now()  # the database's time: moments are by its clock
            await self._wake_due(now)
            done = 0
            while self._later and _moment(self._later[0]) <= now + SEAL_AHEAD:
                held = heapq.heappop(self._later)
                prepare(held)
                heapq.heappush(self._soon, held)
                done += 1
                if done % FIRE_BATCH == 0:
                    await anyio.lowlevel.checkpoint()
                    now = clock.now()
                    await self._fire_due(fire, now)
            await self._fire_due(fire, now)
            wait = 60.0  # at least every minute: a clock step must not stretch a wait
            if self._soon:
                wait = min(wait, (_moment(self._soon[0]) - now).total_seconds())
            if self._later:
                wait = min(wait, (_moment(self._later[0]) - SEAL_AHEAD - now).total_seconds())
            if self._held is not None and (wakes := self._held.far.next_wake()) is not None:
                wait = min(wait, (wakes - now).total_seconds())
            if wait <= TIMER_SPIN_SEC:
                # The loop's sleeps end on the next whole millisecond: the last one is polled.
                await anyio.lowlevel.checkpoint()
                continue
            # Wake for the next moment (or the next to seal), or a newer earlier one.
            self._changed = anyio.Event()
            with anyio.move_on_after(wait - TIMER_SPIN_SEC):
                await self._changed.wait()

    async def _wake_due(self, now: dt.datetime) -> None:
        """Put the dozing timers whose bucket wakes by ``now`` on the heap, FIRE_BATCH at a
        time."""
        while self._held is not None and (woken := self._held.wake_due(now, FIRE_BATCH)):
            for held in woken:
                heapq.heappush(self._later, held)
            await anyio.lowlevel.checkpoint()

    async def _fire_due(self, fire: Callable[[Held], None], now: dt.datetime) -> None:
        """Fire the prepared timers whose moment has passed by ``now``, FIRE_BATCH at a time."""
        fired = 0
        while self._soon and _moment(self._soon[0]) <= now:
            fire(heapq.heappop(self._soon))
            fired += 1
            if fired % FIRE_BATCH == 0:
                await anyio.lowlevel.checkpoint()
