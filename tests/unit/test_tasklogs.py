"""The pure rules of task logs: the bound per try, and when a followed try is over."""

from __future__ import annotations

import datetime as dt

import pytest

from deferral.store.tasklogs import NewLine, TrySize, cut_marker, try_is_over, within_bound

NOW = dt.datetime(2024, 5, 1, tzinfo=dt.UTC)


def _lines(*spec: tuple[str, str]) -> list[NewLine]:
    return [NewLine(1, 1, NOW, source, text) for source, text in spec]


def test_lines_within_the_bound_are_kept_and_counted() -> None:
    kept, size = within_bound(_lines(("task", "abc"), ("triggerer", "de")), TrySize(5), 10)
    assert [line.text for line in kept] == ["abc", "de"]
    assert size == TrySize(10, False)


def test_the_first_line_past_the_bound_becomes_the_marker_and_worker_lines_stay() -> None:
    kept, size = within_bound(
        _lines(("task", "abcd"), ("task", "e"), ("worker", "failed"), ("triggerer", "f")),
        TrySize(7),
        10,
    )
    assert [(line.source, line.text) for line in kept] == [
        ("cut", cut_marker(10)),
        ("worker", "failed"),
    ]
    assert size == TrySize(7, True)


def test_a_cut_try_keeps_only_worker_lines() -> None:
    kept, size = within_bound(_lines(("task", "a"), ("worker", "w")), TrySize(3, True), 10)
    assert [line.text for line in kept] == ["w"]
    assert size == TrySize(3, True)


@pytest.mark.parametrize(
    ("state", "current_try", "over"),
    [
        ("running", 2, False),
        ("deferred", 2, False),
        ("scheduled", 2, False),
        ("up_for_reschedule", 2, False),
        ("up_for_retry", 2, True),
        ("success", 2, True),
        ("failed", 2, True),
        ("none", 2, True),
        ("running", 3, True),
    ],
)
def test_when_a_followed_try_is_over(state: str, current_try: int, over: bool) -> None:
    assert try_is_over(state, current_try, 2) is over
