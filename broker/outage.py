"""Redis failing for a server reason (unreachable, loading, a read-only replica, ``maxmemory``
reached with ``noeviction``), told once per process however many loops hit it
(broker/DECISIONS.md rule 35).

Every loop of a service retries on its own; each hands its failure to :data:`REDIS`, which
says it in one line when the outage starts, again once a minute while it lasts (with the error
of the moment and where it was met), and in one line when it is over, and shows it as the gauge
``deferral_redis_unavailable`` and the counter ``deferral_redis_errors_total``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from deferral.runtime import metrics
from deferral.runtime.faults import REDIS_DOWN

log = logging.getLogger("deferral.broker")

REPEAT_SEC = 60.0
# Over once no call failed for this long: a loop that only reads (allowed under maxmemory)
# succeeding between two refused writes does not end it. Longer than the retries' backoff cap.
QUIET_SEC = 10.0


class RedisOutage:
    """The process's account of Redis failing: its start, its duration, its end."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.lock = threading.Lock()
        self.since: float | None = None
        self.said_at = 0.0
        self.failed_at = 0.0
        self.failures = 0

    def failed(self, exc: BaseException, doing: str) -> bool:
        """Count ``exc`` met while ``doing`` if it is Redis failing (True), saying so when due;
        False for any other error, which the caller handles."""
        if not isinstance(exc, REDIS_DOWN):
            return False
        metrics.REDIS_ERRORS.labels(type(exc).__name__).inc()
        with self.lock:
            now = self.failed_at = self.clock()
            self.failures += 1
            if self.since is None:
                self.since = self.said_at = now
                metrics.REDIS_UNAVAILABLE.set(1)
                log.warning(
                    "Redis unavailable (%s: %s) while %s; retrying (said again once a minute)",
                    type(exc).__name__,
                    exc,
                    doing,
                )
            elif now - self.said_at >= REPEAT_SEC:
                self.said_at = now
                log.warning(
                    "Redis unavailable for %.0f s (%s: %s) while %s; %d call(s) failed; retrying",
                    now - self.since,
                    type(exc).__name__,
                    exc,
                    doing,
                    self.failures,
                )
        return True

    def worked(self) -> None:
        """A call to Redis succeeded: the outage is over if none failed for ``QUIET_SEC``."""
        if self.since is None:  # the usual case, without taking the lock
            return
        with self.lock:
            now = self.clock()
            if self.since is None or now - self.failed_at < QUIET_SEC:
                return
            log.info(
                "Redis available again after %.0f s (%d call(s) failed meanwhile)",
                self.failed_at - self.since,
                self.failures,
            )
            self.since, self.failures = None, 0
            metrics.REDIS_UNAVAILABLE.set(0)


REDIS = RedisOutage()
