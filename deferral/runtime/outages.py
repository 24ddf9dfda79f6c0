"""One process-wide account of a server outage: every loop and thread that meets a transient
error reports it here, and the log gets one line when the outage starts, one a minute while it
lasts (with the error of the moment) and one when it ends -- not a line per attempt per thread.

An outage ends when the loops have reached their servers for ``SETTLE_SEC`` with no transient
error from anyone: a step that happened not to touch the database (a worker polling Redis
between heartbeats) is no evidence PostgreSQL is back. Until then ``available`` is False and
the ``deferral_servers_available`` gauge says 0 (a service's readiness). Redis failing as a
server (unreachable, loading, read-only, full: ``faults.redis_down``) is also counted by error in
``deferral_redis_errors_total`` and shown by ``deferral_redis_unavailable`` until the outage ends.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from deferral.runtime import metrics
from deferral.runtime.faults import redis_down

# While an outage lasts, how often its current error is logged again.
REPEAT_SEC = 60.0
# How many heartbeats every report must be a success before the outage is said to be over: a
# worker's database work comes once a heartbeat between its Redis polls, and a failing loop
# retries at least twice a heartbeat (broker rule 37).
SETTLE_HEARTBEATS = 2.0
# The settling of a process that has not said its heartbeat (two of the default one).
SETTLE_SEC = 10.0


class Outage:
    def __init__(
        self,
        logger: logging.Logger,
        *,
        clock: Callable[[], float] = time.monotonic,
        settle_sec: float = SETTLE_SEC,
    ) -> None:
        self.log = logger
        self.clock = clock
        self.settle_sec = settle_sec
        self._lock = threading.Lock()
        self.since: float | None = None  # when the outage began; None: none now
        self._said_at = 0.0
        self._ok_since: float | None = None  # successes only since then (within an outage)

    @property
    def available(self) -> bool:
        return self.since is None

    def failed(self, exc: BaseException, doing: str = "") -> None:
        """A transient ``exc`` met while ``doing`` something; said at the outage's start and
        every REPEAT_SEC after."""
        what = f"{type(exc).__name__}: {first_line(exc)}" + (f"; {doing}" if doing else "")
        if redis_down(exc):
            metrics.REDIS_ERRORS.labels(type(exc).__name__).inc()
            metrics.REDIS_UNAVAILABLE.set(1)
        with self._lock:
            now = self.clock()
            self._ok_since = None
            metrics.SERVERS_AVAILABLE.set(0)
            if self.since is None:
                self.since = self._said_at = now
                self.log.warning("servers unavailable (%s); retrying", what)
            elif now - self._said_at >= REPEAT_SEC:
                self._said_at = now
                self.log.warning(
                    "servers still unavailable after %.0f s (%s); retrying",
                    now - self.since,
                    what,
                    exc_info=exc,  # where it is stuck
                )

    def redis_failed(self, exc: BaseException, doing: str = "") -> bool:
        """:meth:`failed` if ``exc`` is Redis failing as a server (True); False for any other
        error, which the caller handles (a loop that tells Redis apart from bad data)."""
        if not redis_down(exc):
            return False
        self.failed(exc, doing)
        return True

    def reached(self) -> None:
        """A step reached its servers; the outage ends once nothing failed for SETTLE_SEC."""
        if self.since is None:
            return
        with self._lock:
            now = self.clock()
            if self.since is None:
                return
            if self._ok_since is None:
                self._ok_since = now
            elif now - self._ok_since >= self.settle_sec:
                self.log.info("servers available again after %.0f s", self._ok_since - self.since)
                self.since = self._ok_since = None
                metrics.SERVERS_AVAILABLE.set(1)
                metrics.REDIS_UNAVAILABLE.set(0)


def settle_over_heartbeats(heartbeat_sec: float) -> None:
    """Make the process's outage settle over ``SETTLE_HEARTBEATS`` of its ``heartbeat_sec``: a
    fixed span shorter than a long heartbeat would end an outage between two failing tries."""
    OUTAGE.settle_sec = SETTLE_HEARTBEATS * heartbeat_sec


def first_line(exc: BaseException) -> str:
    """The first line of ``exc``'s message (a DBAPI error's own, without SQLAlchemy's SQL)."""
    lines = str(getattr(exc, "orig", None) or exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__


# The one every loop of this process reports to.
OUTAGE = Outage(logging.getLogger("deferral.outage"))
# And what a scrape meets: /metrics during an outage says it with the rest, once a minute.
metrics.ReadWhenScraped.outage = OUTAGE
