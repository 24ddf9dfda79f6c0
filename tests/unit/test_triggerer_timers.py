"""The triggerer's shared timer fires each held moment when it comes, earliest first, including
one added later that is earlier than those waiting."""

from __future__ import annotations

import datetime as dt

import anyio
import anyio.lowlevel

from broker.replies import Entry
from triggerer.held import Held
from triggerer.timers import FIRE_BATCH, SEAL_AHEAD, Timers


def _held(trigger_id: int, seconds: float) -> Held:
    moment = dt.datetime.now(dt.UTC) + dt.timedelta(seconds=seconds)
    entry = Entry("s", f"{trigger_id}-0", {})
    return Held(trigger_id, entry, None, "d.r.t", trigger_id, 1, moment=moment)


def test_timers_fire_in_order_as_their_moments_come() -> None:
    fired: list[int] = []

    async def until(count: int) -> None:
        with anyio.fail_after(30):
            while len(fired) < count:
                await anyio.sleep(0.01)

    async def main() -> None:
        timers = Timers()
        timers.add(_held(1, 3600.2))
        timers.add(_held(2, 3600.0))
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(timers.run, lambda held: fired.append(held.trigger_id))
            for _ in range(5):  # the timer starts and sleeps until 2's moment, an hour away
                await anyio.lowlevel.checkpoint()
            timers.add(_held(3, 0.0))  # earlier than everything waiting: wakes the timer
            timers.add(_held(4, 0.0))
            await until(2)
            timers.add(_held(5, 0.2))  # earliest first, whatever the order they were added in
            timers.add(_held(6, 0.1))
            await until(4)
            tasks.cancel_scope.cancel()

    anyio.run(main)
    assert fired == [3, 4, 6, 5]  # and 1 and 2 wait for their moments


def test_many_timers_due_at_once_let_the_publisher_run_between_batches() -> None:
    fired: list[int] = []
    seen_by_publisher: list[int] = []
    due = 3 * FIRE_BATCH

    async def publisher() -> None:
        while len(fired) < due:
            if fired:
                seen_by_publisher.append(len(fired))
            await anyio.lowlevel.checkpoint()

    async def main() -> None:
        timers = Timers()
        for i in range(due):
            timers.add(_held(i, -1.0))
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(publisher)
            tasks.start_soon(timers.run, lambda held: fired.append(held.trigger_id))
            with anyio.fail_after(5):
                while len(fired) < due:
                    await anyio.sleep(0.01)
            tasks.cancel_scope.cancel()

    anyio.run(main)
    assert seen_by_publisher and seen_by_publisher[0] == FIRE_BATCH


def test_a_timers_event_is_prepared_shortly_before_its_moment_not_as_it_is_held() -> None:
    """Memory per held timer: a sealed event is kept only from SEAL_AHEAD before the moment,
    and it is always ready before the timer fires."""
    done: list[tuple[str, int]] = []

    async def main() -> None:
        timers = Timers()
        timers.add(_held(1, 3600.0))  # an hour away: nothing sealed for it yet
        timers.add(_held(2, SEAL_AHEAD.total_seconds() / 10))
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(
                timers.run,
                lambda held: done.append(("fired", held.trigger_id)),
                lambda held: done.append(("prepared", held.trigger_id)),
            )
            with anyio.fail_after(30):
                while ("fired", 2) not in done:
                    await anyio.sleep(0.01)
            tasks.cancel_scope.cancel()

    anyio.run(main)
    assert done == [("prepared", 2), ("fired", 2)]


def test_a_held_timer_keeps_its_entrys_name_only() -> None:
    """Memory per held timer (triggerer rule 35): no fields, token or sealed event on it; the
    entry is built with its in-flight index field when it is retired."""
    entry = Entry("s", "7-0", {b"trigger_id": b"7", b"token": b"x" * 400})
    held = Held(7, entry, None, "d.r.t", 7, 1, moment=dt.datetime.now(dt.UTC))
    assert not hasattr(held, "__dict__") and "event" not in Held.__slots__
    assert held.entry == Entry("s", "7-0", {b"trigger_id": b"7"})
    assert held.key == ("s", "7-0") and held.entry_id is entry.id
    assert not held.cancelled and held.cancel_reason == "shutdown"
    held.cancelled, held.cancel_reason = True, "reassigned"
    assert held.cancelled and held.cancel_reason == "reassigned"
