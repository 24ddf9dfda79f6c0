"""Airflow 3's ``airflow.timetables.trigger.CronTriggerTimetable``: a run at each cron point,
whose logical date is that point (not the start of an interval that ended there, as
``CronDataIntervalTimetable``); its data interval is the ``interval`` before it (empty by
default)."""

from __future__ import annotations

import datetime as dt
import zoneinfo
from typing import Any

from deferral.timetables import (
    CronDataIntervalTimetable,
    DagRunInfo,
    DataInterval,
    InvalidSchedule,
    TimeRestriction,
    Timetable,
    zone_name,
)


def zone(timezone: str | dt.tzinfo) -> dt.tzinfo:
    if isinstance(timezone, dt.tzinfo):
        return timezone
    try:
        return zoneinfo.ZoneInfo(timezone)
    except (zoneinfo.ZoneInfoNotFoundError, ValueError, TypeError):
        raise InvalidSchedule(f"timezone {timezone!r:.60} is not a time zone") from None


class CronTriggerTimetable(Timetable):
    needs_start_date = False

    def __init__(
        self,
        cron: str,
        *,
        timezone: str | dt.tzinfo,
        interval: dt.timedelta = dt.timedelta(0),
        run_immediately: bool | dt.timedelta = False,
    ) -> None:
        if not isinstance(interval, dt.timedelta) or interval < dt.timedelta(0):
            raise InvalidSchedule(f"interval must be a timedelta of 0 or more, got {interval!r}")
        self._points = CronDataIntervalTimetable(cron, zone(timezone))
        self._interval = interval
        self._run_immediately = run_immediately
        self.summary = cron
        self.description = f"at each point of {cron!r}, in {timezone}"

    def __repr__(self) -> str:
        return f"CronTriggerTimetable({self.summary!r})"

    def _serialize(self) -> dict[str, Any] | None:
        zone = zone_name(self._points._timezone)
        if zone is None:
            return None
        data: dict[str, Any] = {
            "type": "cron_trigger",
            "cron": self._points._given,
            "timezone": zone,
            "interval": self._interval.total_seconds(),
        }
        if isinstance(self._run_immediately, dt.timedelta):
            return {**data, "run_immediately_within": self._run_immediately.total_seconds()}
        return {**data, "run_immediately": bool(self._run_immediately)}

    def _first_run(self, now: dt.datetime) -> dt.datetime:
        """With no earliest date and no run yet: ``run_immediately`` says whether the latest
        point before ``now`` runs (True, or within that timedelta of ``now``) or the next."""
        previous = self._points._align_to_prev(now)
        if self._run_immediately is True or (
            isinstance(self._run_immediately, dt.timedelta)
            and now - previous <= self._run_immediately
        ):
            return previous
        return self._points._align_to_next(now)

    def next_dagrun_info(
        self,
        *,
        last_automated_data_interval: DataInterval | None,
        restriction: TimeRestriction,
        now: dt.datetime,
    ) -> DagRunInfo | None:
        earliest = restriction.earliest
        if restriction.catchup:
            if last_automated_data_interval is not None:
                point = self._points._get_next(last_automated_data_interval.end)
            elif earliest is None:
                return None
            else:
                point = self._points._align_to_next(earliest)
        else:
            # Without catchup: the latest point that has passed, never one already run.
            candidates = [self._points._align_to_prev(now)]
            if last_automated_data_interval is not None:
                candidates.append(self._points._get_next(last_automated_data_interval.end))
            elif earliest is None:
                candidates.append(self._first_run(now))
            if earliest is not None:
                candidates.append(self._points._align_to_next(earliest))
            point = max(candidates)
        if restriction.latest is not None and point > restriction.latest:
            return None
        return DagRunInfo.interval(point - self._interval, point)

    def infer_manual_data_interval(self, *, run_after: dt.datetime) -> DataInterval:
        return DataInterval(run_after - self._interval, run_after)
