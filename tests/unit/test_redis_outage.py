"""Redis failing, as the process's one outage account (deferral/runtime/outages.py) tells it:
one line when it starts, one a minute while it lasts, one at its end, and meanwhile the gauge
``deferral_redis_unavailable`` and the counter ``deferral_redis_errors_total`` by error."""

from __future__ import annotations

import logging

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import OutOfMemoryError, ResponseError
from sqlalchemy.exc import OperationalError

from deferral.runtime import metrics, outages
from deferral.runtime.outages import REPEAT_SEC, SETTLE_SEC, Outage


def _errors(kind: str) -> float:
    return metrics.REDIS_ERRORS.labels(kind)._value.get()


def test_redis_failing_is_said_once_a_minute_counted_and_shown_until_it_settles(
    caplog: pytest.LogCaptureFixture,
) -> None:
    now = [0.0]
    account = Outage(logging.getLogger("deferral.outage"), clock=lambda: now[0])
    caplog.set_level("INFO", logger="deferral.outage")
    ooms = _errors("OutOfMemoryError")

    # Loops failing every second for two and a half minutes, a read answered between: Redis
    # full refuses writes, not reads, so a success alone does not end it.
    while now[0] < 2.5 * REPEAT_SEC:
        assert account.redis_failed(RedisConnectionError("refused"), "reading")
        assert account.redis_failed(OutOfMemoryError("command not allowed"), "publishing")
        account.reached()
        assert metrics.REDIS_UNAVAILABLE._value.get() == 1
        assert metrics.SERVERS_AVAILABLE._value.get() == 0
        now[0] += 1.0
    account.reached()
    now[0] += SETTLE_SEC
    account.reached()

    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 4, said
    assert said[0] == "servers unavailable (ConnectionError: refused; reading); retrying"
    assert said[1].startswith("servers still unavailable after 60 s (")
    assert said[2].startswith("servers still unavailable after 120 s (")
    assert said[3] == "servers available again after 149 s"  # to the first success after it
    assert metrics.REDIS_UNAVAILABLE._value.get() == 0
    assert metrics.SERVERS_AVAILABLE._value.get() == 1
    assert _errors("OutOfMemoryError") - ooms == 150


@pytest.mark.parametrize(
    "error",
    [
        ResponseError("NOGROUP No such key"),  # a lost stream: recreated, not an outage
        ResponseError("WRONGTYPE"),
        OperationalError("SELECT 1", {}, Exception("pg down")),
        KeyError("a bug"),
    ],
)
def test_other_errors_are_left_to_the_caller(error: Exception) -> None:
    account = Outage(logging.getLogger("deferral.outage"))
    assert not account.redis_failed(error, "doing")
    assert account.available


@pytest.mark.parametrize("heartbeat_sec", [1.0, 30.0])
def test_the_process_outage_settles_over_two_of_its_heartbeats(
    heartbeat_sec: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A loop failing with backoff up to half a heartbeat fails again within a settling of two
    heartbeats: a fixed 10 s ended an outage between two tries of a 30 s heartbeat."""
    now = [0.0]
    account = Outage(logging.getLogger("deferral.outage"), clock=lambda: now[0])
    monkeypatch.setattr(outages, "OUTAGE", account)
    outages.settle_over_heartbeats(heartbeat_sec)

    account.failed(RedisConnectionError("refused"))
    account.reached()
    now[0] += 2 * heartbeat_sec - 0.1
    account.reached()
    assert not account.available
    now[0] += 0.1
    account.reached()
    assert account.available
