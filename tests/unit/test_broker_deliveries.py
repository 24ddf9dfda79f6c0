"""The consumer core's pure decisions: size limits, whose delivery counts are believed, which
pending entries are taken now, and which consumers are deleted."""

from __future__ import annotations

import pytest

from broker.deliveries import (
    MAX_ENTRY_BYTES,
    MAX_ENTRY_FIELDS,
    Candidate,
    Judged,
    OwnerRecord,
    choose,
    judge_replay,
    judge_takeover,
    over_limits,
    prunable,
)

HB = 1.0  # heartbeat, seconds
DEAD = OwnerRecord(running=True, heartbeat_age_sec=30.0)  # stopped heartbeating 30 s ago
ALIVE = OwnerRecord(running=True, heartbeat_age_sec=0.5)
STOPPED = OwnerRecord(running=False, heartbeat_age_sec=30.0)


def test_entries_within_the_limits_pass() -> None:
    assert over_limits({b"trigger_id": b"1", b"token": b"x" * 1000}) is None
    assert over_limits({}) is None


def test_too_many_fields_names_the_limit() -> None:
    fields = {str(i).encode(): b"v" for i in range(4000)}
    assert over_limits(fields) == (
        f"entry of 4000 fields is over the limit of {MAX_ENTRY_FIELDS} fields"
    )


def test_too_many_bytes_names_the_limit() -> None:
    reason = over_limits({b"payload": b"x" * (10 * 1024 * 1024)})
    assert (
        reason
        == f"entry of {10 * 1024 * 1024 + 7} bytes is over the limit of {MAX_ENTRY_BYTES} bytes"
    )


@pytest.mark.parametrize(
    ("redis_count", "idle_ms", "owner", "unregistered_for", "expected"),
    [
        # A registered process that died holding it (last beat around when it went idle).
        (3, 29_000, DEAD, 0.0, Judged(3)),
        (0, 29_000, DEAD, 0.0, Judged(0)),
        (1, 2_500, OwnerRecord(True, 2.0), 0.0, Judged(1)),
        # Forged: a name no process is registered under; left two heartbeats, then count ignored.
        (10, 3_600_000, None, 0.0, Judged(0, wait=True)),
        (10, 3_600_000, None, 1.9, Judged(0, wait=True)),
        (10, 3_600_000, None, 2.0, Judged(0, "held by 'x', which is not a registered consumer")),
        (0, 3_600_000, None, 5.0, Judged(0)),
        # Forged on a live process's name: it heartbeated long after the entry went idle.
        (
            10,
            3_600_000,
            ALIVE,
            0.0,
            Judged(
                0,
                "'x' heartbeated 0.5 s ago, after the entry went idle 3600.0 s ago: it did not"
                " die holding it",
            ),
        ),
        # A dead process's name, but an idle time that its heartbeats contradict.
        (
            10,
            3_600_000,
            DEAD,
            0.0,
            Judged(
                0,
                "'x' heartbeated 30.0 s ago, after the entry went"
                " idle 3600.0 s ago: it did not die holding it",
            ),
        ),
        # Stopped cleanly (handed its entries off): none of them killed it; nothing to log.
        (2, 600_000, STOPPED, 0.0, Judged(0)),
    ],
)
def test_judge_takeover(
    redis_count: int,
    idle_ms: int,
    owner: OwnerRecord | None,
    unregistered_for: float,
    expected: Judged,
) -> None:
    judged = judge_takeover(
        redis_count, idle_ms, "x", owner, heartbeat_sec=HB, unregistered_for_sec=unregistered_for
    )
    assert judged == expected


@pytest.mark.parametrize(
    ("redis_count", "previous", "expected"),
    [
        (2, DEAD, Judged(2)),
        (2, ALIVE, Judged(2)),  # restarted within the staleness margin: its row still looks alive
        (2, STOPPED, Judged(0)),
        (10, None, Judged(0, "no earlier process of this name is registered")),
        (0, None, Judged(0)),
    ],
)
def test_judge_replay(redis_count: int, previous: OwnerRecord | None, expected: Judged) -> None:
    assert judge_replay(redis_count, previous) == expected


@pytest.mark.parametrize(
    ("counted", "suspect_allowed", "expected"),
    [
        # Survivors and entries past the cap (max 3) together, the least delivered suspect alone.
        ({"1-0": 0, "2-0": 2, "3-0": 1, "4-0": 3, "5-0": 1}, True, ["1-0", "4-0", "3-0"]),
        ({"1-0": 0, "2-0": 2, "3-0": 1, "4-0": 3}, False, ["1-0", "4-0"]),
        ({"10-0": 1, "9-0": 1}, True, ["9-0"]),  # ids compared as numbers
        ({"1-0": 5}, False, ["1-0"]),
        ({}, True, []),
    ],
)
def test_choose(counted: dict[str, int], suspect_allowed: bool, expected: list[str]) -> None:
    candidates = [Candidate(i, c) for i, c in counted.items()]
    assert choose(candidates, 3, suspect_allowed=suspect_allowed) == expected


def test_prunable_keeps_self_live_and_busy_consumers() -> None:
    consumers = {"me": 0, "live": 0, "busy-dead": 4, "dead": 0, "stopped": 0, "x": 0}
    owners = {
        "me": ALIVE,
        "live": ALIVE,
        "busy-dead": DEAD,
        "dead": DEAD,
        "stopped": STOPPED,
    }
    assert prunable(consumers, owners, me="me", heartbeat_sec=HB) == ["dead", "stopped", "x"]
