"""The database's clock, as this process reads it: time triggers fire by PostgreSQL's clock, not
by the host's (deferral/DECISIONS.md).

Every service measures the offset between its host clock and PostgreSQL's ``clock_timestamp()``
when it registers and at every heartbeat (:func:`observe`, in its registration's transaction);
:func:`now` is the host's time corrected by that offset. An offset within :data:`DEAD_BAND_SEC`
is the measurement's own noise and is not applied. A host more than :data:`WARN_SKEW_SEC` off
says so in its log, once a minute at most, and ``deferral_clock_skew_seconds`` shows the skew.

``DEFERRAL_TEST_CLOCK_OFFSET_SEC`` (tests only) sets the host clock that far ahead (negative:
behind), as a host whose clock is wrong would have it.
"""

from __future__ import annotations

import datetime as dt
import logging
import os
import threading
import time

from sqlalchemy import text
from sqlalchemy.orm import Session

from deferral.runtime import metrics

log = logging.getLogger("deferral.clock")

TEST_OFFSET_ENV = "DEFERRAL_TEST_CLOCK_OFFSET_SEC"
# Offsets this small are the round trip's noise, not a wrong clock.
DEAD_BAND_SEC = 0.01
# A host clock further off the database's than this is logged.
WARN_SKEW_SEC = 1.0
# At most one such line per this many seconds.
WARN_EVERY_SEC = 60.0

_SKEW_SQL = text("SELECT clock_timestamp()")

_lock = threading.Lock()
_host_ahead = dt.timedelta(seconds=float(os.environ.get(TEST_OFFSET_ENV) or 0))
# What to add to the host's time to read the database's.
_correction = dt.timedelta(0)
_warned_at: float | None = None


def host_now() -> dt.datetime:
    """The host clock's time (aware, UTC)."""
    return dt.datetime.now(dt.UTC) + _host_ahead


def now() -> dt.datetime:
    """The database's time as last measured against the host clock (aware, UTC)."""
    return host_now() + _correction


def correction_sec() -> float:
    """What :func:`now` adds to the host's time, in seconds (handed to a task process)."""
    return _correction.total_seconds()


def correct_by(seconds: float) -> None:
    """Take the correction another process of this host measured (a worker's, in its task
    process, which reaches no database of its own)."""
    global _correction
    _correction = dt.timedelta(seconds=seconds)


def skew_of(database: dt.datetime, after: dt.datetime) -> float:
    """How far the host clock is ahead of the database's (seconds; negative: behind), from the
    database's time read and the host's time ``after`` the read came back. The read happened
    at some host time before ``after``: this is the largest the skew can be, so a time
    corrected by it is never later than the database's and no timer fires early (one may fire
    up to a round trip late)."""
    return (after - database).total_seconds()


def correction_for(skew: float) -> dt.timedelta:
    """What :func:`now` adds to the host's time for a measured ``skew``: nothing within the
    dead band."""
    return dt.timedelta(0) if abs(skew) < DEAD_BAND_SEC else dt.timedelta(seconds=-skew)


def warn_due(skew: float, warned_at: float | None, at: float) -> bool:
    """Whether a skew measured at monotonic time ``at`` is logged: it is over the bound and the
    last line (at ``warned_at``) is a minute old, or there was none."""
    if abs(skew) <= WARN_SKEW_SEC:
        return False
    return warned_at is None or at - warned_at >= WARN_EVERY_SEC


def observe(session: Session) -> float:
    """Measure the host clock against the database's through ``session``, correct :func:`now`
    by it, set the metric and log a large skew (once a minute at most); returns the skew."""
    global _correction, _warned_at
    database = session.scalar(_SKEW_SQL)
    assert isinstance(database, dt.datetime)
    skew = skew_of(database, host_now())
    metrics.CLOCK_SKEW.set(skew)
    with _lock:
        _correction = correction_for(skew)
        at = time.monotonic()
        due = warn_due(skew, _warned_at, at)
        if due:
            _warned_at = at
    if due:
        log.warning(
            "this host's clock is %.1f s %s PostgreSQL's: time triggers fire by PostgreSQL's"
            " clock; fix the host's time synchronisation (NTP)",
            abs(skew),
            "ahead of" if skew > 0 else "behind",
        )
    return skew
