"""Pure decisions of the worker, tested on their own."""

from __future__ import annotations

import datetime as dt


def execution_deadline(
    first_started_at: dt.datetime, execution_timeout: dt.timedelta | None
) -> dt.datetime | None:
    """execution_timeout runs from the try's first start, across deferrals."""
    return None if execution_timeout is None else first_started_at + execution_timeout


def trigger_timeout(
    now: dt.datetime, timeout: dt.timedelta | None, deadline: dt.datetime | None
) -> dt.datetime | None:
    """A deferral ends at the earlier of ``now + timeout`` and the execution deadline."""
    candidates = [m for m in (None if timeout is None else now + timeout, deadline) if m]
    return min(candidates) if candidates else None


def stop_action(now: float, handing_back_at: float, running: int, unrecorded: int) -> str:
    """What a worker stopped by SIGTERM does next (monotonic times): ``done`` once nothing runs
    and every outcome is recorded; ``hand_back`` the attempts still running once its stop
    grace ran out (``handing_back_at``); else ``wait`` for them to end."""
    if not running and not unrecorded:
        return "done"
    if running and now >= handing_back_at:
        return "hand_back"
    return "wait"
