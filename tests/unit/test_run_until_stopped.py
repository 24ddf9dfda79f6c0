"""Service loops outlive Redis and Postgres outages, and bugs in one loop."""

from __future__ import annotations

import logging
import threading

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError
from sqlalchemy.exc import OperationalError

from broker.consumer import Backoff, run_until_stopped
from deferral.runtime import metrics
from deferral.runtime.outages import Outage


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


def test_a_services_backoff_is_capped_below_its_heartbeat() -> None:
    """While PostgreSQL is away a step is still tried twice a heartbeat: its lease renewal
    (Redis only) must come before peers take its entries over."""
    stop = Clock()
    calls: list[int] = []

    def step() -> None:
        calls.append(1)
        if len(calls) <= 5:
            raise OperationalError("SELECT 1", {}, Exception("pg down"))
        stop.set()

    run_until_stopped(stop, step, recover=lambda: None, backoff_cap=0.25)
    assert stop.waited == [0.1, 0.2, 0.25, 0.25, 0.25]


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


def test_a_long_outage_is_said_again_with_its_current_error(
    caplog: pytest.LogCaptureFixture,
) -> None:
    stop = Clock()
    now = [0.0]
    errors = [RedisConnectionError("refused")] * 2 + [RedisConnectionError("cluster is down")] * 5
    outage = Outage(logging.getLogger("deferral.outage"), clock=lambda: now[0])

    def step() -> None:
        now[0] += 25.0
        if errors:
            raise errors.pop(0)
        if now[0] > 250:
            stop.set()

    caplog.set_level("INFO", logger="deferral.outage")
    run_until_stopped(stop, step, recover=lambda: None, outage=outage)
    said = [r.getMessage() for r in caplog.records]
    assert said == [
        "servers unavailable (ConnectionError: refused); retrying",
        "servers still unavailable after 75 s (ConnectionError: cluster is down); retrying",
        "servers still unavailable after 150 s (ConnectionError: cluster is down); retrying",
        "servers available again after 175 s",
    ]


def test_an_outage_met_by_several_loops_between_their_successes_is_one_outage(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A worker's heartbeat fails each second while its Redis polls between succeed: one line
    for the outage, readiness 0 throughout, and it ends only after SETTLE_SEC of successes."""
    now = [0.0]
    outage = Outage(logging.getLogger("deferral.outage"), clock=lambda: now[0], settle_sec=10)
    caplog.set_level("INFO", logger="deferral.outage")
    down = OperationalError("SELECT 1", {}, Exception("connection refused"))
    for second in range(30):
        now[0] = second
        outage.failed(down, "recording the heartbeat")
        now[0] = second + 0.5
        outage.reached()
        assert not outage.available
        assert metrics.SERVERS_AVAILABLE._value.get() == 0
    for tick in range(12):
        now[0] = 30 + tick
        outage.reached()
    assert outage.available
    assert metrics.SERVERS_AVAILABLE._value.get() == 1
    assert [r.getMessage() for r in caplog.records] == [
        "servers unavailable (OperationalError: connection refused; recording the heartbeat);"
        " retrying",
        "servers available again after 30 s",
    ]
