"""Naive datetimes in DAG definitions are read in ``DEFERRAL_DEFAULT_TIMEZONE`` (default UTC), as
Airflow reads them in its default timezone: most DAG files write ``datetime(2024, 1, 1)``.

Values that travel between processes (defer kwargs, XComs, event payloads) stay tz-aware only;
this module is for what a DAG file declares.

Pendulum's ``DateTime`` and ``Duration`` (what Airflow's own examples write) are subclasses of
``datetime`` and ``timedelta`` whose arithmetic is their own: ``DateTime + timedelta(days=1)``
adds 24 hours across a DST change where ``datetime`` adds a wall day, and a ``Duration`` of
months counts them as 30 days unless added to a ``DateTime``. What a DAG declares is turned into
the standard types here, once, so every schedule and deadline computes as deferral documents.
"""

from __future__ import annotations

import datetime as dt
from zoneinfo import ZoneInfo

from dateutil.relativedelta import relativedelta

from deferral.runtime.config import default_timezone


def standard_datetime(value: dt.datetime) -> dt.datetime:
    """``value`` as a ``datetime`` itself (not a subclass such as pendulum's ``DateTime``): the
    same wall time and zone (a named zone stays named, any other becomes its fixed offset)."""
    zone = value.tzinfo
    if type(value) is dt.datetime and (zone is None or type(zone) in (ZoneInfo, dt.timezone)):
        return value
    if isinstance(zone, ZoneInfo):
        zone = ZoneInfo(zone.key)
    elif zone is not None:
        offset = value.utcoffset()
        zone = None if offset is None else dt.timezone(offset)
    return dt.datetime(
        value.year,
        value.month,
        value.day,
        value.hour,
        value.minute,
        value.second,
        value.microsecond,
        tzinfo=zone,
        fold=value.fold,
    )


def make_aware(value: dt.datetime) -> dt.datetime:
    """``value`` as a standard datetime, with the default time zone if it had none."""
    value = standard_datetime(value)
    if value.tzinfo is not None and value.utcoffset() is not None:
        return value
    return value.replace(tzinfo=default_timezone())


def standard_timedelta(value: dt.timedelta) -> dt.timedelta:
    """``value`` as a ``timedelta`` itself (a pendulum ``Duration``'s months count 30 days and
    its years 365, as pendulum's own ``total_seconds()`` counts them)."""
    if type(value) is dt.timedelta:
        return value
    return dt.timedelta(days=value.days, seconds=value.seconds, microseconds=value.microseconds)


def calendar_delta(value: dt.timedelta | relativedelta) -> dt.timedelta | relativedelta:
    """A schedule's delta in standard types: a pendulum ``Duration`` with years or months
    becomes the ``relativedelta`` that adds them as calendar months, as Airflow's timetable
    adds it to a pendulum ``DateTime``; any other duration a ``timedelta``."""
    if isinstance(value, relativedelta):
        return value
    years, months = getattr(value, "years", 0), getattr(value, "months", 0)
    if not (years or months):
        return standard_timedelta(value)
    rest = standard_timedelta(value) - dt.timedelta(days=365 * years + 30 * months)
    return relativedelta(
        years=years,
        months=months,
        days=rest.days,
        seconds=rest.seconds,
        microseconds=rest.microseconds,
    )
