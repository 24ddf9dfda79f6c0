"""When a running trigger is no longer wanted by its task, and why."""

from __future__ import annotations

import pytest

from deferral.store.transitions import TIMED_OUT
from triggerer.decide import SUPERSEDED, TIMEOUT, USER_ACTION, cancel_reason


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
