"""Far timers doze in columns (triggerer rule 35): what a dozing timer wakes as is what was held,
asking for one by id wakes it alone, listing them wakes none, and a bucket wakes DOZE_AHEAD
before it begins -- then fires on time from the shared timer."""

from __future__ import annotations

import datetime as dt

import anyio
import pytest

from broker.replies import Entry
from deferral.runtime import clock
from triggerer.held import Held
from triggerer.holding import BUCKET, DOZE_AHEAD, HeldTriggers
from triggerer.timers import Timers

NOW = dt.datetime(2026, 12, 7, 12, 0, tzinfo=dt.UTC)


def _timer(trigger_id: int, moment: dt.datetime, stream: str = "p:triggers") -> Held:
    entry = Entry(stream, f"1765108800123-{trigger_id}", {b"token": b"x" * 400})
    return Held(trigger_id, entry, None, f"dåg.run.t{trigger_id}[3]", trigger_id + 1000, 2, moment)


def _dozing(*timers: Held) -> HeldTriggers:
    held = HeldTriggers()
    for timer in timers:
        held[timer.trigger_id] = timer
        assert held.doze(timer)
    return held


def _same(a: Held, b: Held) -> bool:
    return (a.trigger_id, a.key, a.task, a.task_instance_id, a.try_number, a.moment) == (
        b.trigger_id,
        b.key,
        b.task,
        b.task_instance_id,
        b.try_number,
        b.moment,
    ) and (a.scope, a.why, a.retire) == (None, None, False)


def test_a_dozing_timer_wakes_as_it_was_held_and_only_when_asked_for() -> None:
    original = _timer(7, NOW + dt.timedelta(hours=1, microseconds=123457))
    other = _timer(8, NOW + dt.timedelta(hours=2), stream="p:{shard:01}:triggers")
    held = _dozing(original, other)
    scheduled: list[Held] = []
    held.schedule = scheduled.append
    # Listing, counting and membership wake nothing.
    assert sorted(held) == [7, 8] and len(held) == 2 and 7 in held and 9 not in held
    assert sorted(zip(*held.task_instances(), strict=True)) == [(7, 1007), (8, 1008)]
    assert [h.trigger_id for h in held.timers()] == [7, 8] and not held.live and not scheduled
    woken = held.get(7)
    assert (
        woken is not None and _same(woken, original) and woken.entry.fields == {b"trigger_id": b"7"}
    )
    assert held[7] is woken and scheduled == [woken] and len(held) == 2  # stays woken
    assert held.get(9) is None
    del held[8]
    assert list(held) == [7] and 8 not in held


def test_keyed_wakes_the_dozing_timers_of_the_entries_named_only() -> None:
    timers = [_timer(i, NOW + dt.timedelta(hours=1)) for i in range(1, 6)]
    held = _dozing(*timers)
    found = held.keyed({timers[1].key, timers[3].key, ("p:other", "1-1")})
    assert sorted(found) == [2, 4] and all(_same(found[i], timers[i - 1]) for i in (2, 4))
    assert sorted(held.live) == [2, 4] and len(held.far) == 3


def test_buckets_wake_in_order_doze_ahead_of_their_start_a_batch_at_a_time() -> None:
    early = [_timer(i, NOW + dt.timedelta(hours=1)) for i in range(10)]
    late = _timer(99, NOW + dt.timedelta(hours=1) + 3 * BUCKET)
    held = _dozing(late, *early)
    del held[3]  # a removed timer does not wake
    wakes = held.far.next_wake()
    assert wakes is not None and NOW + dt.timedelta(hours=1) - DOZE_AHEAD - BUCKET < wakes
    assert held.wake_due(wakes - dt.timedelta(milliseconds=1), 100) == []
    first = held.wake_due(wakes, 4)
    rest = held.wake_due(wakes, 100)
    assert len(first) == 4 and len(rest) == 5 and 99 not in {h.trigger_id for h in rest}
    assert {h.trigger_id for h in first + rest} == set(range(10)) - {3}
    assert all(held.live[h.trigger_id] is h for h in first + rest)
    assert held.far.trigger_ids() == [99]
    again = first[0]  # held anew (a new entry) after it woke: it dozes again
    assert held.doze(again) and held.far.trigger_ids() == sorted([again.trigger_id, 99])
    assert len(held) == 10 and held.get(again.trigger_id) is not None


def test_what_cannot_be_kept_in_columns_stays_a_held() -> None:
    async def main() -> None:
        offset = dt.timezone(dt.timedelta(hours=2))
        held = HeldTriggers()
        not_utc = _timer(1, (NOW + dt.timedelta(hours=1)).astimezone(offset))
        runs_code = Held(2, Entry("s", "1-2", {}), anyio.CancelScope(), "d.r.t", 2, 1)
        odd_id = Held(3, Entry("s", "x", {}), None, "d.r.t", 3, 1, NOW)
        for timer in (not_utc, runs_code, odd_id):
            held[timer.trigger_id] = timer
            assert not held.doze(timer) and held[timer.trigger_id] is timer
        assert not held.far

    anyio.run(main)


def test_a_far_timer_dozes_and_fires_at_its_moment(monkeypatch: pytest.MonkeyPatch) -> None:
    real_now = clock.now
    moment = real_now() + dt.timedelta(hours=1)
    original = _timer(7, moment)
    fired: list[Held] = []

    async def main() -> None:
        held = HeldTriggers()
        timers = Timers(held)
        held[7] = original
        timers.add(original)
        assert not held.live and held.far.trigger_ids() == [7] and len(timers) == 1
        # An hour later, less a second: the timer wakes, is sealed and fires at its moment.
        ahead = moment - real_now() - dt.timedelta(seconds=1)
        monkeypatch.setattr(clock, "now", lambda: real_now() + ahead)
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(timers.run, fired.append)
            with anyio.fail_after(10):
                while not fired:
                    await anyio.sleep(0.01)
            tasks.cancel_scope.cancel()
        assert clock.now() >= moment

    anyio.run(main)
    assert len(fired) == 1 and _same(fired[0], original)
