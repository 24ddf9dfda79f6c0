"""Service loops outlive Redis and Postgres outages."""

from __future__ import annotations

import threading
from typing import Any

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError
from sqlalchemy.exc import OperationalError

from broker.client import run_until_stopped


class FakeBroker:
    def __init__(self) -> None:
        self.groups: list[tuple[str, str]] = []

    def ensure_group(self, stream: str, group: str) -> None:
        self.groups.append((stream, group))


@pytest.mark.parametrize(
    "outage",
    [RedisConnectionError("redis down"), OperationalError("SELECT 1", {}, Exception("pg down"))],
)
def test_a_failing_step_pauses_recreates_the_group_and_goes_on(outage: Exception) -> None:
    stop = threading.Event()
    broker = FakeBroker()
    calls: list[int] = []

    def step() -> None:
        calls.append(1)
        if len(calls) == 1:
            raise outage
        stop.set()

    waited: list[float] = []
    original_wait = stop.wait
    stop.wait = lambda timeout=None: waited.append(timeout) or original_wait(0)  # type: ignore[method-assign,assignment,func-returns-value]
    run_until_stopped(broker, stop, step, "s", "g")  # type: ignore[arg-type]
    assert len(calls) == 2
    assert broker.groups == [("s", "g")]
    assert waited == [1.0]


def test_other_errors_are_not_swallowed() -> None:
    def step() -> Any:
        raise KeyError("bug")

    with pytest.raises(KeyError):
        run_until_stopped(FakeBroker(), threading.Event(), step, "s", "g")  # type: ignore[arg-type]
