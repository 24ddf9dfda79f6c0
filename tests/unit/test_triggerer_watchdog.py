"""The blocked-loop watchdog names the task that held the loop, and for how long."""

from __future__ import annotations

import time

import anyio

from triggerer.watchdog import LoopWatchdog, StallTracker


def test_a_stall_is_reported_once_when_it_ends_naming_the_task_current_at_its_start() -> None:
    tracker = StallTracker(threshold=0.2)
    assert tracker.observe(now=10.1, last_stamp=10.0, current="idle") is None  # no stall
    assert tracker.observe(now=10.5, last_stamp=10.0, current="trigger 7") is None  # stalled
    assert tracker.observe(now=11.0, last_stamp=10.0, current="trigger 7") is None  # still
    report = tracker.observe(now=11.3, last_stamp=11.25, current="watchdog")  # moving again
    assert report == ("trigger 7", 1.25)
    assert tracker.observe(now=11.4, last_stamp=11.35, current=None) is None  # reported once


def test_unknown_culprit_when_no_task_is_current() -> None:
    tracker = StallTracker(threshold=0.2)
    tracker.observe(now=1.0, last_stamp=0.0, current=None)
    assert tracker.observe(now=1.1, last_stamp=1.05, current=None) == ("unknown code", 1.05)


def test_watchdog_names_a_blocking_task_in_a_real_event_loop() -> None:
    reports: list[tuple[str, float]] = []
    culprit = "trigger 42 (x.Blocking) for d.r.t"

    def named() -> list[float]:
        return [seconds for name, seconds in reports if name == culprit]

    async def main() -> None:
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(LoopWatchdog(0.1, lambda *r: reports.append(r), 0.02).run)
            await anyio.sleep(0.1)

            async def blocker() -> None:
                time.sleep(0.5)  # the bug the watchdog exists for

            tasks.start_soon(blocker, name=culprit)
            # Reported once the loop moves again and the watchdog's thread looks: wait for it
            # (a loaded machine may take its time), then a little longer for a second report.
            with anyio.fail_after(30):
                while not named():
                    await anyio.sleep(0.02)
            await anyio.sleep(0.2)
            tasks.cancel_scope.cancel()

    anyio.run(main)
    # Once, and at least as long as the block (a loaded machine makes it longer, never shorter).
    # A stall of the whole process under load may add reports naming other tasks: not this one.
    (seconds,) = named()
    assert seconds > 0.4
