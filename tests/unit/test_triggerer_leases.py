"""The lease thread's beat: renews through its own broker, hands what was lost on without
waiting, and never stops beating because a beat failed."""

from __future__ import annotations

from typing import Any, cast

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError

from broker import outage
from broker.client import Broker, LeaseStatus
from broker.consumer import Lost, StreamConsumer
from triggerer.leases import LeaseKeeper


class FakeConsumer:
    def __init__(self, *results: list[Lost] | Exception) -> None:
        self.results = list(results)
        self.via: list[Any] = []

    def renew(self, via: Any = None) -> list[Lost]:
        self.via.append(via)
        result = self.results.pop(0)
        if isinstance(result, Exception):
            raise result
        return result


def _keeper(consumer: FakeConsumer, register: Any, lost: list[list[Lost]]) -> LeaseKeeper:
    own_broker = cast(Broker, object())
    return LeaseKeeper(
        cast(StreamConsumer, consumer),
        own_broker,
        heartbeat_sec=1.0,
        register=register,
        on_beat=lost.append,
    )


def test_a_beat_renews_through_its_own_broker_and_hands_itself_on_with_the_lost() -> None:
    taken = [Lost("1-0", LeaseStatus.TAKEN)]
    consumer = FakeConsumer([], taken)
    registered: list[bool] = []
    lost: list[list[Lost]] = []
    keeper = _keeper(consumer, lambda: registered.append(True), lost)
    keeper.beat()
    keeper.beat()
    assert consumer.via == [keeper.broker, keeper.broker]
    assert lost == [[], taken]  # every beat is handed on, with what it lost
    assert registered == [True, True]


def test_a_failing_beat_is_logged_and_the_next_one_runs(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(outage, "REDIS", outage.RedisOutage())
    consumer = FakeConsumer(RedisConnectionError("down"), ValueError("a bug"), [])
    failures = iter([RuntimeError("db bug"), None, None])

    def register() -> None:
        failure = next(failures)
        if failure is not None:
            raise failure

    keeper = _keeper(consumer, register, [])
    for _ in range(3):
        keeper.beat()  # never raises: the thread must keep beating
    assert keeper.beats == 3
    said = caplog.text
    # Redis failing: said once by the process's account of it.
    assert "Redis unavailable (ConnectionError: down) while renewing leases" in said
    assert "renewing leases failed unexpectedly" in said and "ValueError: a bug" in said
    assert "recording the heartbeat failed unexpectedly" in said
