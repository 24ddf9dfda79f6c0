"""The consumer core's pure decisions: size limits, which pending entries are suspects and whose
start evidence is believed, which are taken together and which one at a time, when a process may
run a suspect, when a start is proven, and which consumers are deleted."""

from __future__ import annotations

import pytest

from broker.deliveries import (
    MAX_ENTRY_BYTES,
    MAX_ENTRY_FIELDS,
    Candidate,
    Judged,
    OwnerRecord,
    SortedOut,
    due_for_proof,
    judge_replay,
    judge_takeover,
    may_run_suspect,
    over_limits,
    prunable,
    sort_out,
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
    ("started", "idle_ms", "owner", "unregistered_for", "expected"),
    [
        # A registered process that died holding it while its start evidence stood: a suspect.
        (3, 29_000, DEAD, 0.0, Judged(3, suspect=True)),
        (0, 29_000, DEAD, 0.0, Judged(0, suspect=True)),
        (1, 2_500, OwnerRecord(True, 2.0), 0.0, Judged(1, suspect=True)),
        # Delivered but never started (or it ran a whole heartbeat since): no suspect.
        (None, 29_000, DEAD, 0.0, Judged(0)),
        # Forged: a name no process is registered under; left two heartbeats, then ignored.
        (10, 3_600_000, None, 0.0, Judged(0, wait=True)),
        (10, 3_600_000, None, 1.9, Judged(0, wait=True)),
        (
            10,
            3_600_000,
            None,
            2.0,
            Judged(0, distrusted="held by 'x', which is not a registered consumer"),
        ),
        (None, 3_600_000, None, 5.0, Judged(0)),
        # Forged on a live process's name: it heartbeated long after the entry went idle.
        (
            10,
            3_600_000,
            ALIVE,
            0.0,
            Judged(
                0,
                distrusted="'x' heartbeated 0.5 s ago, after the entry went idle 3600.0 s ago:"
                " it did not die holding it",
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
                distrusted="'x' heartbeated 30.0 s ago, after the entry went"
                " idle 3600.0 s ago: it did not die holding it",
            ),
        ),
        # Stopped cleanly (handed its entries off): none of them killed it; nothing to log.
        (2, 600_000, STOPPED, 0.0, Judged(0)),
    ],
)
def test_judge_takeover(
    started: int | None,
    idle_ms: int,
    owner: OwnerRecord | None,
    unregistered_for: float,
    expected: Judged,
) -> None:
    judged = judge_takeover(
        started, idle_ms, "x", owner, heartbeat_sec=HB, unregistered_for_sec=unregistered_for
    )
    assert judged == expected


@pytest.mark.parametrize(
    ("started", "previous", "expected"),
    [
        (2, DEAD, Judged(2, suspect=True)),
        # Restarted within the staleness margin: its row still looks alive.
        (2, ALIVE, Judged(2, suspect=True)),
        (0, ALIVE, Judged(0, suspect=True)),
        (None, DEAD, Judged(0)),  # delivered to it but never started
        (2, STOPPED, Judged(0)),
        (10, None, Judged(0, distrusted="no earlier process of this name is registered")),
        (None, None, Judged(0)),
    ],
)
def test_judge_replay(started: int | None, previous: OwnerRecord | None, expected: Judged) -> None:
    assert judge_replay(started, previous) == expected


def _suspect(counted: int) -> Judged:
    return Judged(counted, suspect=True)


@pytest.mark.parametrize(
    ("judged", "free", "suspects"),
    [
        # No suspects and suspects past the cap (max 3) together, in the order given; the
        # others least counted first, so the healthy ones beside a poison run before it again.
        (
            {
                "1-0": Judged(0),
                "2-0": _suspect(2),
                "3-0": _suspect(0),
                "4-0": _suspect(3),
                "5-0": _suspect(0),
                "6-0": Judged(0, distrusted="forged"),
            },
            ["1-0", "4-0", "6-0"],
            ["3-0", "5-0", "2-0"],
        ),
        ({"10-0": _suspect(1), "9-0": _suspect(1)}, [], ["9-0", "10-0"]),  # ids as numbers
        ({"1-0": _suspect(5)}, ["1-0"], []),
        ({}, [], []),
    ],
)
def test_sort_out(judged: dict[str, Judged], free: list[str], suspects: list[str]) -> None:
    candidates = [Candidate(i, j) for i, j in judged.items()]
    assert sort_out(candidates, 3) == SortedOut(free, suspects)


@pytest.mark.parametrize(
    ("running_suspect", "unproven", "expected"),
    [
        (False, 0, True),
        (False, 1, False),  # a poison among what it started would be blamed on the suspect
        (True, 0, False),  # one suspect per process
        (True, 3, False),
    ],
)
def test_may_run_suspect(running_suspect: bool, unproven: int, expected: bool) -> None:
    assert may_run_suspect(running_suspect, unproven) is expected


def test_due_for_proof_after_a_whole_heartbeat() -> None:
    started = {"1-0": 10.0, "2-0": 10.5, "3-0": 11.2}
    assert due_for_proof(started, 11.5, HB) == ["1-0", "2-0"]
    assert due_for_proof(started, 10.9, HB) == []


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
