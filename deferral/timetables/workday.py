"""``AfterWorkdayTimetable``: the timetable of Airflow's example plugin (``workday.py``, which
``example_workday_timetable.py`` imports as ``airflow.example_dags.plugins.workday``): one run
a working day, for the day (midnight to midnight, UTC), created once the day is over.

Working days are Monday to Friday. Airflow's plugin also looks holidays up in pandas' US federal
calendar when pandas is installed, but compares the calendar's naive dates with its tz-aware
days, which are never equal: no holiday is skipped there either, so none is here."""

from __future__ import annotations

import datetime as dt
from typing import Any

from deferral.timetables import DagRunInfo, DataInterval, TimeRestriction, Timetable

_DAY = dt.timedelta(days=1)
_SATURDAY = 5


def _midnight(day: dt.date) -> dt.datetime:
    return dt.datetime.combine(day, dt.time.min, tzinfo=dt.UTC)


def _workday(day: dt.datetime, step: dt.timedelta) -> dt.datetime:
    """``day``, or the first working day from it in the direction of ``step``."""
    while day.weekday() >= _SATURDAY:
        day += step
    return day


class AfterWorkdayTimetable(Timetable):
    """Daily runs on working days (Monday to Friday), each for its day in UTC."""

    def _serialize(self) -> dict[str, Any] | None:
        return {"type": "after_workday"}

    def infer_manual_data_interval(self, *, run_after: dt.datetime) -> DataInterval:
        """The last working day before ``run_after``'s day (UTC)."""
        start = _workday(_midnight(run_after.astimezone(dt.UTC).date() - _DAY), -_DAY)
        return DataInterval(start, start + _DAY)

    def next_dagrun_info(
        self,
        *,
        last_automated_data_interval: DataInterval | None,
        restriction: TimeRestriction,
        now: dt.datetime,
    ) -> DagRunInfo | None:
        if last_automated_data_interval is not None:
            start = _midnight(last_automated_data_interval.start.astimezone(dt.UTC).date() + _DAY)
        elif restriction.earliest is None:
            return None
        else:
            earliest = restriction.earliest.astimezone(dt.UTC)
            if not restriction.catchup:
                start = max(earliest, _midnight(now.astimezone(dt.UTC).date()))
            elif earliest.time() != dt.time.min:
                start = _midnight(earliest.date() + _DAY)
            else:
                start = earliest
        start = _workday(start, _DAY)
        if restriction.latest is not None and start > restriction.latest:
            return None
        return DagRunInfo.interval(start, start + _DAY)
