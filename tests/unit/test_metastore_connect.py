"""A task process's metastore connects patiently: a server refusing for a moment costs task
code a wait, not its try (deferral/DECISIONS.md 107)."""

from __future__ import annotations

import psycopg
import pytest

from deferral.store.metastore import LONGEST_PAUSE_SEC, patiently


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0
        self.pauses: list[float] = []

    def sleep(self, seconds: float) -> None:
        self.pauses.append(seconds)
        self.now += seconds


def test_a_refused_connect_is_tried_again_with_growing_pauses() -> None:
    clock, tries = _Clock(), []

    def connect() -> str:
        tries.append(clock.now)
        if len(tries) < 4:
            raise psycopg.OperationalError("connection failed: FATAL:  too many clients already")
        return "connected"

    assert patiently(connect, clock=lambda: clock.now, sleep=clock.sleep) == "connected"
    assert clock.pauses == [0.1, 0.2, 0.4]


def test_it_gives_up_after_its_patience_with_the_last_error() -> None:
    clock = _Clock()

    def connect() -> str:
        raise psycopg.errors.CannotConnectNow(f"starting up ({clock.now:.1f})")

    with pytest.raises(psycopg.errors.CannotConnectNow):
        patiently(connect, patience=10, clock=lambda: clock.now, sleep=clock.sleep)
    assert sum(clock.pauses) <= 10
    assert max(clock.pauses) == LONGEST_PAUSE_SEC


def test_an_error_that_does_not_pass_is_raised_at_once() -> None:
    clock = _Clock()

    def connect() -> str:
        raise psycopg.errors.InvalidCatalogName("database does not exist")

    with pytest.raises(psycopg.errors.InvalidCatalogName):
        patiently(connect, clock=lambda: clock.now, sleep=clock.sleep)
    assert clock.pauses == []
