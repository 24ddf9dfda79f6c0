"""A process's one account of Redis failing (broker/outage.py): one line when it starts, one a
minute while it lasts, one at its end; the gauge and the counter meanwhile."""

from __future__ import annotations

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import OutOfMemoryError, ResponseError
from sqlalchemy.exc import OperationalError

from broker.outage import QUIET_SEC, REPEAT_SEC, RedisOutage
from deferral.runtime import metrics


def _errors(kind: str) -> float:
    return metrics.REDIS_ERRORS.labels(kind)._value.get()


def test_an_outage_is_said_once_a_minute_and_its_end_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    now = [0.0]
    account = RedisOutage(clock=lambda: now[0])
    caplog.set_level("INFO", logger="deferral.broker")
    ooms = _errors("OutOfMemoryError")

    # Three loops failing every second for two and a half minutes, one read succeeding between.
    while now[0] < 2.5 * REPEAT_SEC:
        assert account.failed(RedisConnectionError("refused"), "reading")
        assert account.failed(OutOfMemoryError("command not allowed"), "publishing")
        account.worked()  # a read answered: not over while writes are refused
        assert metrics.REDIS_UNAVAILABLE._value.get() == 1
        now[0] += 1.0
    now[0] += QUIET_SEC
    account.worked()

    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 4, said
    assert said[0].startswith("Redis unavailable (ConnectionError: refused) while reading")
    assert said[1].startswith("Redis unavailable for 60 s (")
    assert said[2].startswith("Redis unavailable for 120 s (")
    assert said[3] == "Redis available again after 149 s (300 call(s) failed meanwhile)"
    assert metrics.REDIS_UNAVAILABLE._value.get() == 0
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
    account = RedisOutage()
    assert not account.failed(error, "doing")
    assert account.since is None
