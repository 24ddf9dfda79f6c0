"""Rate limits of the writes that store something on a caller's say: signals sent through the
API (per user or API token, and per callback token for callback answers) and runs triggered
(per user or API token, API and trigger form alike). Past a limit a write is refused with 429
and Retry-After, before any database work.

The counting is the ``limits`` library's sliding window counter in this process's memory: two
counters per key and limit, so memory stays small however fast a key sends; the keys are users,
API tokens and verified callback tokens, never anything a caller makes up. Each webserver
replica counts on its own (N replicas let N times the rate through); what bounds storage
whatever the rate is the per-user quota of kept signals (``deferral.signals.Sender``) and the
retention of runs.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from limits import RateLimitItem, parse_many
from limits.storage import MemoryStorage
from limits.strategies import SlidingWindowCounterRateLimiter

from deferral.runtime.config import WebserverSettings

SIGNALS, RUNS = "signals", "runs"


@dataclass(frozen=True)
class Refusal:
    """A write refused by its rate limit: the one line to answer, and when to try again."""

    message: str
    retry_after_sec: int


def limited_as(acting: str) -> str:
    """Whom a write by ``acting`` (a web user's name, or an API token's ``token:<name>``)
    counts against."""
    return acting if acting.startswith("token:") else f"user:{acting}"


class WriteLimits:
    def __init__(self, settings: WebserverSettings, clock: Callable[[], float] = time.time) -> None:
        self._limiter = SlidingWindowCounterRateLimiter(MemoryStorage())
        self._rates: dict[str, list[RateLimitItem]] = {
            SIGNALS: parse_many(settings.signal_rate),
            RUNS: parse_many(settings.run_rate),
        }
        self._clock = clock

    def take(self, kind: str, who: str) -> Refusal | None:
        """Count one write of ``kind`` by ``who`` (``user:<name>``, ``token:<API token name>``
        or ``token:<callback key>``) if every
        limit of the kind has room; else the refusal (nothing counted)."""
        rates = self._rates[kind]
        for rate in rates:
            if not self._limiter.test(rate, kind, who):
                reset_at = self._limiter.get_window_stats(rate, kind, who).reset_time
                wait = max(1, math.ceil(reset_at - self._clock()))
                return Refusal(f"too many {kind}: at most {rate}", wait)
        for rate in rates:
            self._limiter.hit(rate, kind, who)
        return None
