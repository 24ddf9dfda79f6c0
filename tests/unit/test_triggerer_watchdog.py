"""The stall monitor names the task that held the loop, where it held it, and for how long."""

from __future__ import annotations

import asyncio
import time

import anyio

from broker.replies import Entry
from triggerer.service import Held, RunningTrigger, _culprit_named
from triggerer.watchdog import LoopWatchdog, StallEnded, StallStarted, StallTracker


def test_a_stall_is_reported_as_it_starts_and_when_it_ends_naming_the_culprit_at_its_start() -> (
    None
):
    tracker: StallTracker[str] = StallTracker(threshold=0.2)
    assert tracker.observe(now=10.1, last_stamp=10.0, current="idle") is None  # no stall
    started = tracker.observe(now=10.5, last_stamp=10.0, current="trigger 7")
    assert started == StallStarted("trigger 7", 10.0)
    assert tracker.observe(now=11.0, last_stamp=10.0, current="trigger 7") is None  # still
    ended = tracker.observe(now=11.3, last_stamp=11.25, current="watchdog")  # moving again
    assert ended == StallEnded("trigger 7", 1.25)
    assert tracker.observe(now=11.4, last_stamp=11.35, current=None) is None  # reported once


def test_no_culprit_when_no_trigger_is_current() -> None:
    tracker: StallTracker[str] = StallTracker(threshold=0.2)
    assert tracker.observe(now=1.0, last_stamp=0.0, current=None) == StallStarted(None, 0.0)
    assert tracker.observe(now=1.1, last_stamp=1.05, current=None) == StallEnded(None, 1.05)


def _block_the_loop() -> None:
    time.sleep(0.5)  # the bug the watchdog exists for


def test_watchdog_names_a_blocking_task_and_samples_its_stack_in_a_real_event_loop() -> None:
    stalls: list[tuple[str | None, str]] = []
    blocks: list[tuple[str | None, float]] = []
    culprits: dict[asyncio.Task[object], str] = {}

    async def main() -> None:
        async with anyio.create_task_group() as tasks:
            watchdog: LoopWatchdog[str] = LoopWatchdog(
                0.1,
                lambda task: None if task is None else culprits.get(task),
                lambda culprit, stack: stalls.append((culprit, stack)),
                lambda culprit, seconds: blocks.append((culprit, seconds)),
                0.02,
            )
            tasks.start_soon(watchdog.run)
            await anyio.sleep(0.1)

            async def blocker() -> None:
                me = asyncio.current_task()
                assert me is not None
                culprits[me] = "trigger 42"
                _block_the_loop()

            tasks.start_soon(blocker)
            # Reported once the loop moves again and the watchdog's thread looks: wait for it
            # (a loaded machine may take its time).
            with anyio.fail_after(30):
                while not any(culprit == "trigger 42" for culprit, _ in blocks):
                    await anyio.sleep(0.02)
            tasks.cancel_scope.cancel()

    anyio.run(main)
    # A stall of the whole process under load may add reports naming no trigger: not this one.
    (stack,) = [stack for culprit, stack in stalls if culprit == "trigger 42"]
    # Sampled while the loop was held: the innermost frames are the blocking call's.
    assert "in _block_the_loop" in stack
    assert "time.sleep(0.5)" in stack.splitlines()[-1]
    # At least as long as the block (a loaded machine makes it longer, never shorter).
    (seconds,) = [seconds for culprit, seconds in blocks if culprit == "trigger 42"]
    assert seconds > 0.4


def test_a_stall_names_the_trigger_from_data_or_else_the_task() -> None:
    held = Held(7, Entry("s", "1-0", {}), None, "d.r.t", 3, 1)
    name, extra = _culprit_named(RunningTrigger(held, "x.Blocking"))
    assert name == "trigger 7 (x.Blocking) for d.r.t"
    assert extra == held.log_ids()  # so the report goes to the try's log too
    assert _culprit_named("Task-3") == ("task 'Task-3' (no trigger)", {})
    assert _culprit_named(None) == ("code outside any task", {})
