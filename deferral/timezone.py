"""Naive datetimes in DAG definitions are read in ``DEFERRAL_DEFAULT_TIMEZONE`` (default UTC), as
Airflow reads them in its default timezone: most DAG files write ``datetime(2024, 1, 1)``.

Values that travel between processes (defer kwargs, XComs, event payloads) stay tz-aware only;
this module is for what a DAG file declares.
"""

from __future__ import annotations

import datetime as dt

from deferral.config import default_timezone


def make_aware(value: dt.datetime) -> dt.datetime:
    """``value`` itself if it has a zone, else the same wall time in the default time zone."""
    if value.tzinfo is not None and value.utcoffset() is not None:
        return value
    return value.replace(tzinfo=default_timezone())
