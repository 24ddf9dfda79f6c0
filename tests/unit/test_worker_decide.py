"""worker.decide: execution deadlines, deferral timeouts and __fail__ messages."""

from __future__ import annotations

import datetime as dt

from worker.decide import execution_deadline, trigger_timeout

NOW = dt.datetime(2024, 1, 1, 12, 0, tzinfo=dt.UTC)


def test_execution_deadline() -> None:
    start = NOW - dt.timedelta(minutes=3)
    assert execution_deadline(start, None) is None
    assert execution_deadline(start, dt.timedelta(minutes=10)) == NOW + dt.timedelta(minutes=7)


def test_trigger_timeout_none_when_neither_is_set() -> None:
    assert trigger_timeout(NOW, None, None) is None


def test_trigger_timeout_from_timeout_only() -> None:
    assert trigger_timeout(NOW, dt.timedelta(hours=1), None) == NOW + dt.timedelta(hours=1)


def test_trigger_timeout_from_deadline_only() -> None:
    deadline = NOW + dt.timedelta(minutes=2)
    assert trigger_timeout(NOW, None, deadline) == deadline


def test_trigger_timeout_is_the_earlier_of_both() -> None:
    soon = NOW + dt.timedelta(minutes=2)
    later = NOW + dt.timedelta(hours=2)
    assert trigger_timeout(NOW, dt.timedelta(hours=1), soon) == soon
    assert trigger_timeout(NOW, dt.timedelta(minutes=1), later) == NOW + dt.timedelta(minutes=1)


def test_trigger_timeout_with_zero_timeout_is_now() -> None:
    assert trigger_timeout(NOW, dt.timedelta(0), None) == NOW


def test_trigger_timeout_with_deadline_already_passed() -> None:
    passed = NOW - dt.timedelta(seconds=1)
    assert trigger_timeout(NOW, dt.timedelta(hours=1), passed) == passed


def test_trigger_timeout_compares_instants_across_offsets() -> None:
    # The deadline is earlier in absolute time even though its wall-clock reads later.
    deadline = dt.datetime(2024, 1, 1, 13, 30, tzinfo=dt.timezone(dt.timedelta(hours=2)))
    assert trigger_timeout(NOW, dt.timedelta(hours=1), deadline) == deadline
