"""Lease timing: pure arithmetic, tested on its own."""

from __future__ import annotations

from dataclasses import dataclass

# An entry idle longer than this many heartbeats belongs to a dead triggerer: a live one renews
# every heartbeat, and the margin covers one late beat plus clock and network jitter.
TAKEOVER_HEARTBEATS = 2.1


@dataclass(frozen=True)
class Lease:
    takeover_after_ms: int
    hand_off_idle_ms: int

    @classmethod
    def of(cls, heartbeat_sec: float) -> Lease:
        takeover = int(heartbeat_sec * TAKEOVER_HEARTBEATS * 1000)
        # A handed-off entry must look older than the takeover threshold, with room to spare.
        return cls(takeover_after_ms=takeover, hand_off_idle_ms=takeover + 60_000)
