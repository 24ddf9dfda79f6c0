"""Housekeeping steps run once per interval, each wait drawn between 80 and 100 % of it, so that
they do not fall due together with work that a wake-up set going."""

from __future__ import annotations

import pytest

from deferral.runtime import process
from deferral.runtime.process import Every


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_step_runs_at_once_then_within_its_interval_and_never_sooner_than_four_fifths(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    clock = Clock()
    monkeypatch.setattr(process.time, "monotonic", clock)
    runs: list[float] = []
    every = Every(10.0, lambda: runs.append(clock.now))
    every()
    assert runs == [1000.0]
    waits = []
    for _ in range(200):
        start = clock.now
        while len(runs) == len(waits) + 1:
            clock.now += 0.05
            every()
        waits.append(clock.now - start)
    assert all(7.95 <= wait <= 10.05 for wait in waits)
    assert max(waits) - min(waits) > 1.0  # spread, not one fixed period


def test_due_in_counts_down_to_zero(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = Clock()
    monkeypatch.setattr(process.time, "monotonic", clock)
    every = Every(1.0, lambda: None)
    assert every.due_in() == 0.0
    every()
    assert 0.8 <= every.due_in() <= 1.0
    clock.now += 5
    assert every.due_in() == 0.0


def test_a_loop_blocks_for_work_until_its_next_step_falls_due(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    clock = Clock()
    monkeypatch.setattr(process.time, "monotonic", clock)
    heartbeat, takeover = Every(5.0, lambda: None), Every(1.25, lambda: None)
    heartbeat.due, takeover.due = clock.now + 4.0, clock.now + 0.3004
    assert process.wait_ms_until_due([heartbeat, takeover], 1000) == 300
    takeover.due = clock.now + 2.0
    assert process.wait_ms_until_due([heartbeat, takeover], 1000) == 1000  # at most the longest
    takeover.due = clock.now - 1.0  # overdue: the shortest block Redis takes, not 0 (for ever)
    assert process.wait_ms_until_due([heartbeat, takeover], 1000) == 1
    assert process.wait_ms_until_due([], 100) == 100
