"""When a running trigger is no longer wanted by its task, and why; how often a triggerer looks
for entries to take over."""

from __future__ import annotations

import pytest

from deferral.store.transitions import TIMED_OUT
from triggerer.decide import SUPERSEDED, TIMEOUT, USER_ACTION, cancel_reason, takeover_every


@pytest.mark.parametrize(
    ("state", "ti_trigger", "left_deferred", "expected"),
    [
        ("deferred", 7, None, None),  # still waiting on this trigger
        ("deferred", 8, "trigger 7 fired", SUPERSEDED),  # resumed, then deferred again
        ("scheduled", None, TIMED_OUT, TIMEOUT),
        ("failed", None, TIMED_OUT, TIMEOUT),  # already failed by the worker since
        ("running", None, "trigger 7 fired", SUPERSEDED),  # another copy of it fired
        ("success", None, "trigger 7 failed", SUPERSEDED),
        ("none", None, "cleared by admin", USER_ACTION),
        ("success", None, "marked success by admin", USER_ACTION),
        (None, None, None, USER_ACTION),  # row deleted
    ],
)
def test_cancel_reason(
    state: str | None, ti_trigger: int | None, left_deferred: str | None, expected: str | None
) -> None:
    assert cancel_reason(7, state, ti_trigger, left_deferred) == expected


@pytest.mark.parametrize(
    ("heartbeat", "every"),
    [(0.3, 0.075), (1.0, 0.25), (2.0, 0.5), (5.0, 0.5), (30.0, 0.5)],
)
def test_takeover_looks_are_four_a_heartbeat_and_half_a_second_apart_at_most(
    heartbeat: float, every: float
) -> None:
    # A stopping peer's hand-off is picked up within a second of its exit at any heartbeat.
    assert takeover_every(heartbeat) == pytest.approx(every)
