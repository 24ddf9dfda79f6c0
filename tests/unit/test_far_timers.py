"""Publish now or later: which deferrals wait as rows (deferral.store.far_timers.far_moment)."""

from __future__ import annotations

import datetime as dt
from typing import Any

import pytest

from deferral.runtime.serialization import check_kwargs
from deferral.store.far_timers import far_moment
from deferral.triggers import DateTimeTrigger, FileTrigger, TimeDeltaTrigger
from deferral.triggers.base import classpath_of

NOW = dt.datetime(2030, 1, 1, 12, 0, tzinfo=dt.UTC)
HORIZON = dt.timedelta(minutes=10)
DATETIME = classpath_of(DateTimeTrigger)
TIMEDELTA = classpath_of(TimeDeltaTrigger)


def _at(delta: dt.timedelta) -> dict[str, Any]:
    """A time trigger's kwargs as the worker carries them, due ``delta`` after NOW."""
    return check_kwargs({"moment": NOW + delta})


@pytest.mark.parametrize(
    ("classpath", "kwargs", "later"),
    [
        (DATETIME, _at(dt.timedelta(hours=1)), True),
        (TIMEDELTA, _at(dt.timedelta(hours=1)), True),
        (DATETIME, _at(HORIZON + dt.timedelta(microseconds=1)), True),
        (DATETIME, _at(HORIZON), False),  # at the horizon: published now
        (DATETIME, _at(dt.timedelta(seconds=5)), False),
        (DATETIME, _at(-dt.timedelta(hours=1)), False),  # already past: fires at once
        (DATETIME, {**_at(dt.timedelta(hours=1)), "end_from_trigger": True}, True),
        # Another zone: the instant decides, not the wall-clock digits.
        (
            DATETIME,
            check_kwargs(
                {
                    "moment": (NOW + dt.timedelta(hours=1)).astimezone(
                        dt.timezone(-dt.timedelta(hours=5))
                    )
                }
            ),
            True,
        ),
        # Triggers that must run are held as today, whatever their kwargs say.
        (classpath_of(FileTrigger), _at(dt.timedelta(hours=1)), False),
        ("dags.my_triggers.DateTimeTrigger", _at(dt.timedelta(hours=1)), False),
        # A time trigger's kwargs without a readable moment: published now (the safe side).
        (DATETIME, {}, False),
        (DATETIME, {"moment": "tomorrow"}, False),
        (DATETIME, {"moment": {"__deferral_type__": "datetime"}}, False),
        (DATETIME, check_kwargs({"moment": dt.timedelta(hours=1)}), False),
    ],
    ids=[
        "datetime-1h",
        "timedelta-1h",
        "just-beyond",
        "at-horizon",
        "near",
        "past",
        "end-from-trigger",
        "other-zone",
        "file-trigger",
        "other-module",
        "no-moment",
        "moment-a-string",
        "malformed-tag",
        "moment-not-a-datetime",
    ],
)
def test_far_moment_says_which_deferrals_wait_as_rows(
    classpath: str, kwargs: dict[str, Any], later: bool
) -> None:
    moment = far_moment(classpath, kwargs, NOW, HORIZON)
    if later:
        assert moment is not None and moment > NOW + HORIZON
    else:
        assert moment is None


def test_far_moment_is_the_triggers_own_moment() -> None:
    at = NOW + dt.timedelta(days=3, microseconds=7)
    assert far_moment(DATETIME, check_kwargs({"moment": at}), NOW, HORIZON) == at


def test_serialized_time_triggers_are_recognised() -> None:
    for trigger in (
        DateTimeTrigger(NOW + dt.timedelta(hours=2)),
        TimeDeltaTrigger(dt.timedelta(hours=2)),
    ):
        classpath, kwargs = trigger.serialize()
        now = dt.datetime.now(dt.UTC)
        assert far_moment(classpath, check_kwargs(kwargs), now, HORIZON) is not None
