"""Service loops outlive Redis and Postgres outages, and bugs in one loop."""

from __future__ import annotations

import threading

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError
from sqlalchemy.exc import OperationalError

from broker import outage
from broker.consumer import Backoff, run_until_stopped


class Clock(threading.Event):
    """A stop event whose waits return at once and are recorded."""

    def __init__(self) -> None:
        super().__init__()
        self.waited: list[float] = []

    def wait(self, timeout: float | None = None) -> bool:
        self.waited.append(timeout or 0)
        return self.is_set()


@pytest.mark.parametrize(
    "outage",
    [
        RedisConnectionError("redis down"),
        OperationalError("SELECT 1", {}, Exception("pg down")),
        KeyError("a bug"),
    ],
)
def test_a_failing_step_backs_off_recovers_and_goes_on(outage: Exception) -> None:
    stop = Clock()
    calls: list[int] = []
    recovered: list[int] = []

    def step() -> None:
        calls.append(1)
        if len(calls) <= 3:
            raise outage
        stop.set()

    run_until_stopped(stop, step, recover=lambda: recovered.append(1))
    assert len(calls) == 4
    assert len(recovered) == 3
    assert stop.waited == [0.1, 0.2, 0.4]  # exponential backoff


def test_once_returns_after_the_first_success() -> None:
    stop = Clock()
    calls: list[int] = []

    def step() -> None:
        calls.append(1)
        if len(calls) == 1:
            raise RedisConnectionError("down")

    assert run_until_stopped(stop, step, recover=lambda: None, once=True) is True
    assert len(calls) == 2


def test_once_reports_a_stop_before_success() -> None:
    stop = Clock()
    stop.set()
    assert run_until_stopped(stop, lambda: None, recover=lambda: None, once=True) is False


def test_backoff_doubles_up_to_its_cap_and_resets() -> None:
    backoff = Backoff(first=1, cap=5)
    assert [backoff.next() for _ in range(5)] == [1, 2, 4, 5, 5]
    backoff.reset()
    assert backoff.next() == 1


def _said(caplog: pytest.LogCaptureFixture, errors: list[Exception], every: float) -> list[str]:
    """The first line of each message logged while a step fails with ``errors`` in turn, one
    every ``every`` seconds of the clock ``outage.REDIS`` reads too, then succeeds."""
    now = [0.0]
    outage.REDIS.clock = lambda: now[0]
    stop = Clock()

    def step() -> None:
        now[0] += every
        if errors:
            raise errors.pop(0)
        stop.set()

    caplog.set_level("INFO", logger="deferral.broker")
    run_until_stopped(stop, step, recover=lambda: None, clock=lambda: now[0])
    return [r.getMessage().split("\n")[0] for r in caplog.records]


@pytest.fixture(autouse=True)
def _own_redis_account(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(outage, "REDIS", outage.RedisOutage())


def test_a_long_outage_is_said_again_with_its_current_error(
    caplog: pytest.LogCaptureFixture,
) -> None:
    errors = [OperationalError("SELECT 1", {}, Exception("refused"))] * 2
    errors += [OperationalError("SELECT 1", {}, Exception("shutting down"))] * 5
    assert _said(caplog, errors, 25.0) == [
        "servers unavailable (OperationalError: (builtins.Exception) refused",
        "servers still unavailable after 75 s (OperationalError: (builtins.Exception) shutting"
        " down",
        "servers still unavailable after 150 s (OperationalError: (builtins.Exception) shutting"
        " down",
        "servers available again",
    ]


def test_redis_failing_is_said_by_the_process_account_of_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    errors: list[Exception] = [RedisConnectionError("refused")] * 3
    assert _said(caplog, errors, 5.0) == [
        "Redis unavailable (ConnectionError: refused) while running"
        " _said.<locals>.step; retrying (said again once a minute)"
    ]
    assert outage.REDIS.since is not None  # over only once no call failed for QUIET_SEC
