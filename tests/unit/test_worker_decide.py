"""worker.decide: execution deadlines, deferral timeouts, __fail__ messages and a stopping worker's
next step."""

from __future__ import annotations

import datetime as dt

import pytest

from worker.decide import execution_deadline, stop_action, trigger_timeout

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


@pytest.mark.parametrize(
    ("now", "running", "unrecorded", "action"),
    [
        (0.0, 2, 0, "wait"),  # attempts running within the grace: let them finish
        (0.0, 0, 1, "wait"),  # outcomes still to record
        (10.0, 0, 1, "wait"),  # past the grace, nothing to hand back: record first
        (0.0, 0, 0, "done"),
        (10.0, 0, 0, "done"),
        (10.0, 2, 0, "hand_back"),  # the grace ran out
        (10.0, 1, 1, "hand_back"),
    ],
)
def test_a_stopping_worker_waits_for_its_attempts_until_the_grace_runs_out(
    now: float, running: int, unrecorded: int, action: str
) -> None:
    assert stop_action(now, 10.0, running, unrecorded) == action
