"""Pure decisions of the worker, tested on their own."""

from __future__ import annotations

import datetime as dt
from typing import Any


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


def failure_message(next_kwargs: dict[str, Any]) -> tuple[bool, str]:
    """For a task resumed at ``__fail__``: (timed_out, message)."""
    if next_kwargs.get("error") == "timeout":
        return True, "the deferral timed out before its trigger fired"
    detail = next_kwargs.get("message") or "trigger failed"
    trace = next_kwargs.get("traceback")
    return False, f"{detail}\n{trace}" if trace else str(detail)
