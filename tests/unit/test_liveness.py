"""What the listings say of a process, from its state and heartbeat age."""

from __future__ import annotations

import datetime as dt

import pytest

from deferral.store import liveness

NOW = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)


@pytest.mark.parametrize(
    ("state", "age_sec", "health"),
    [
        ("running", 1.0, "alive"),
        ("running", 2.1, "alive"),  # 2.1 heartbeats of 1 s: one late beat is not death
        ("running", 2.2, "stale"),  # killed, hung or cut off: it never said it stopped
        ("stopped", 0.5, "stopped"),
        ("stopped", 3600.0, "stopped"),
    ],
)
def test_health_is_alive_stopped_or_stale(state: str, age_sec: float, health: str) -> None:
    heartbeat = NOW - dt.timedelta(seconds=age_sec)
    assert liveness.health(state, heartbeat, NOW, heartbeat_sec=1.0) == health
