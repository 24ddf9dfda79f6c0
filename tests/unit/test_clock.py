"""The database's clock as a process reads it: the skew from one read, the correction applied,
and when a skew is logged."""

from __future__ import annotations

import datetime as dt

import pytest

from deferral.runtime import clock

T0 = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)


def _at(seconds: float) -> dt.datetime:
    return T0 + dt.timedelta(seconds=seconds)


@pytest.mark.parametrize(
    ("database", "after", "skew"),
    [
        (0.0, 0.0, 0.0),
        (0.001, 30.002, 30.001),  # the host 30 s ahead
        (5.0, 0.0, -5.0),  # behind
        (10.0, 10.5, 0.5),  # equal clocks and a slow round trip: at most this much
    ],
)
def test_the_skew_is_its_largest_possible_value_so_no_corrected_time_is_ahead(
    database: float, after: float, skew: float
) -> None:
    assert clock.skew_of(_at(database), _at(after)) == pytest.approx(skew)


@pytest.mark.parametrize(
    ("skew", "correction"),
    [(0.0, 0.0), (0.004, 0.0), (-0.009, 0.0), (0.02, -0.02), (30.0, -30.0), (-2.0, 2.0)],
)
def test_an_offset_within_the_dead_band_is_noise_and_not_applied(
    skew: float, correction: float
) -> None:
    assert clock.correction_for(skew) == dt.timedelta(seconds=correction)


@pytest.mark.parametrize(
    ("skew", "warned_at", "at", "due"),
    [
        (0.5, None, 100.0, False),  # within a second: nothing to say
        (-1.0, None, 100.0, False),
        (1.5, None, 100.0, True),  # the first time
        (-30.0, None, 100.0, True),
        (30.0, 100.0, 159.0, False),  # said within the minute
        (30.0, 100.0, 160.0, True),  # a minute later, again
    ],
)
def test_a_skew_over_a_second_is_logged_once_a_minute_at_most(
    skew: float, warned_at: float | None, at: float, due: bool
) -> None:
    assert clock.warn_due(skew, warned_at, at) is due


def test_a_task_process_takes_its_workers_correction(monkeypatch: pytest.MonkeyPatch) -> None:
    # Forked before its worker measured the skew, it is handed the correction with each attempt.
    monkeypatch.setattr(clock, "_correction", dt.timedelta(0))
    clock.correct_by(-30.0)
    assert clock.correction_sec() == -30.0
    assert (clock.host_now() - clock.now()).total_seconds() == pytest.approx(30, abs=0.1)
