"""Timetables: when a DAG's scheduled runs fall and which data interval each one covers.

Airflow 2.x semantics. A run covers a *data interval* and is created once that interval has
ended: the daily run of 2024-01-01 (its logical date, the interval's start) covers
[2024-01-01, 2024-01-02) and runs after midnight on the 2nd. Cron expressions are evaluated in
the DAG's time zone (so ``0 2 * * *`` stays at 2am local across DST changes); a ``timedelta``
is an absolute duration. Every datetime these functions return is in UTC.

Pure code on typed values: ``now`` is an argument, never read from a clock here.
"""

from __future__ import annotations

import datetime as dt
import inspect
import zoneinfo
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, TypeAlias

from croniter import CroniterError, croniter
from dateutil.relativedelta import relativedelta

UTC = dt.UTC

# Airflow's presets; any other "@..." croniter knows (@midnight, @annually) is read by croniter.
CRON_PRESETS = {
    "@hourly": "0 * * * *",
    "@daily": "0 0 * * *",
    "@weekly": "0 0 * * 0",
    "@monthly": "0 0 1 * *",
    "@quarterly": "0 0 1 */3 *",
    "@yearly": "0 0 1 1 *",
}
ONCE = "@once"
CONTINUOUS = "@continuous"

Delta: TypeAlias = dt.timedelta | relativedelta
Schedule = str | dt.timedelta | relativedelta | None


class InvalidSchedule(ValueError):
    """A ``schedule`` value no timetable can be made of; the message says why."""


@dataclass(frozen=True)
class DataInterval:
    start: dt.datetime
    end: dt.datetime

    @classmethod
    def exact(cls, at: dt.datetime) -> DataInterval:
        return cls(at, at)


@dataclass(frozen=True)
class TimeRestriction:
    """What the DAG allows: runs from ``earliest`` (start_date) to ``latest`` (end_date), and
    whether missed intervals are caught up."""

    earliest: dt.datetime | None
    latest: dt.datetime | None
    catchup: bool


@dataclass(frozen=True)
class DagRunInfo:
    """A run to create: its data interval, and the moment after which it may be created."""

    run_after: dt.datetime
    data_interval: DataInterval

    @property
    def logical_date(self) -> dt.datetime:
        return self.data_interval.start

    @classmethod
    def interval(cls, start: dt.datetime, end: dt.datetime) -> DagRunInfo:
        return cls(run_after=end, data_interval=DataInterval(start, end))

    @classmethod
    def exact(cls, at: dt.datetime) -> DagRunInfo:
        return cls(run_after=at, data_interval=DataInterval.exact(at))


def _utc(value: dt.datetime) -> dt.datetime:
    return value.astimezone(UTC)


class Timetable(ABC):
    """The base of every timetable, deferral's and a DAG file's own (Airflow's
    ``airflow.timetables.base.Timetable``: give an instance as ``schedule=`` or ``timetable=``).

    Deferral's timetables take ``now``; one written for Airflow reads the clock itself and
    its ``next_dagrun_info`` takes no ``now`` (``next_info`` calls either kind)."""

    #: False for ``schedule=None``: only manual runs and nothing to backfill.
    can_be_scheduled = True
    #: Airflow's: whether runs fall at regular intervals (shown, not acted on).
    periodic = True
    #: Airflow's: a longer text about the schedule (shown, not acted on).
    description = ""
    #: Airflow's: its runs are for partitions worked out ahead of the run (a key each).
    partitioned = False
    #: Airflow's: its runs' tasks name the partitions they write, at run time (a run may be
    #: triggered with a key of any form).
    partitioned_at_runtime = False
    #: Whether a DAG scheduled by it must have a start_date (False: it finds its first run
    #: from now, as Airflow 3's trigger timetables do).
    needs_start_date = True

    @property
    def summary(self) -> str:
        """How ``deferral dags list`` and the ``dag`` table show the schedule: the class name
        unless set, as in Airflow."""
        return str(self.__dict__.get("_summary") or type(self).__name__)

    @summary.setter
    def summary(self, value: str) -> None:
        self.__dict__["_summary"] = value

    @abstractmethod
    def next_dagrun_info(
        self,
        *,
        last_automated_data_interval: DataInterval | None,
        restriction: TimeRestriction,
        now: dt.datetime,
    ) -> DagRunInfo | None:
        """The run after the latest scheduled (or backfill) run, None if there is none."""

    @abstractmethod
    def infer_manual_data_interval(self, *, run_after: dt.datetime) -> DataInterval:
        """The data interval of a run triggered by hand at ``run_after``."""

    def serialize(self) -> dict[str, Any] | None:
        """This timetable as a typed, JSON-able dict (``{"type": kind, ...}``) that
        ``deferral.timetables.serialized.deserialize_timetable`` makes again, as Airflow's
        ``Timetable.serialize``; None when it cannot be: a class that does not define
        ``_serialize`` itself (a DAG file's own, even a subclass of a built-in one: only its file
        makes it again), or values JSON cannot hold."""
        own = type(self).__dict__.get("_serialize")
        result: dict[str, Any] | None = own(self) if own is not None else None
        return result


def zone_name(timezone: dt.tzinfo) -> str | None:
    """The IANA name of ``timezone`` (None: one no name makes again)."""
    if isinstance(timezone, zoneinfo.ZoneInfo):
        return timezone.key
    return "UTC" if timezone is UTC else None


class UserTimetableError(InvalidSchedule):
    """A DAG file's own timetable raised, or returned what is not a run: the message names its
    class and the method."""


_BUILT_IN_MODULE = __name__


def is_built_in(timetable: Timetable) -> bool:
    """One of deferral's own timetables (not a DAG file's)."""
    module = type(timetable).__module__
    return module == _BUILT_IN_MODULE or module.startswith(f"{_BUILT_IN_MODULE}.")


def _takes_now(timetable: Timetable) -> bool:
    """Whether ``timetable.next_dagrun_info`` takes ``now`` (deferral's) or not (Airflow's)."""
    parameters = inspect.signature(timetable.next_dagrun_info).parameters
    return "now" in parameters or any(p.kind is p.VAR_KEYWORD for p in parameters.values())


def _aware(timetable: Timetable, method: str, value: object) -> dt.datetime:
    if not isinstance(value, dt.datetime) or value.utcoffset() is None:
        raise UserTimetableError(
            f"timetable {type(timetable).__name__}.{method} returned {value!r}, not a "
            "tz-aware datetime"
        )
    return _utc(value)


def _checked_interval(timetable: Timetable, method: str, value: object) -> DataInterval:
    start, end = getattr(value, "start", None), getattr(value, "end", None)
    return DataInterval(_aware(timetable, method, start), _aware(timetable, method, end))


def _user_call(timetable: Timetable, method: str, call: Any) -> Any:
    """``call()`` of a DAG file's timetable, what it raises said as UserTimetableError."""
    try:
        return call()
    except UserTimetableError:
        raise
    except Exception as exc:
        raise UserTimetableError(
            f"timetable {type(timetable).__name__}.{method} raised {type(exc).__name__}: {exc}"
        ) from exc


def next_info(
    timetable: Timetable,
    *,
    last_automated_data_interval: DataInterval | None,
    restriction: TimeRestriction,
    now: dt.datetime,
) -> DagRunInfo | None:
    """``timetable.next_dagrun_info``, of deferral's kind or Airflow's (no ``now``); what a DAG
    file's timetable returns is checked (tz-aware, in UTC after) and what it raises is a
    UserTimetableError naming it."""
    if is_built_in(timetable):
        return timetable.next_dagrun_info(
            last_automated_data_interval=last_automated_data_interval,
            restriction=restriction,
            now=now,
        )
    kwargs: dict[str, Any] = {
        "last_automated_data_interval": last_automated_data_interval,
        "restriction": restriction,
    }
    if _takes_now(timetable):
        kwargs["now"] = now
    method = "next_dagrun_info"
    info = _user_call(timetable, method, lambda: timetable.next_dagrun_info(**kwargs))
    if info is None:
        return None
    interval = _checked_interval(timetable, method, getattr(info, "data_interval", None))
    return DagRunInfo(_aware(timetable, method, getattr(info, "run_after", None)), interval)


def manual_interval(timetable: Timetable, run_after: dt.datetime) -> DataInterval:
    """``timetable.infer_manual_data_interval(run_after=...)``, checked as ``next_info``."""
    method = "infer_manual_data_interval"
    interval = _user_call(
        timetable, method, lambda: timetable.infer_manual_data_interval(run_after=run_after)
    )
    if is_built_in(timetable):
        return interval
    return _checked_interval(timetable, method, interval)


class NullTimetable(Timetable):
    """``schedule=None``: runs only when triggered."""

    summary = "None"
    can_be_scheduled = False

    def _serialize(self) -> dict[str, Any] | None:
        return {"type": "null"}

    def next_dagrun_info(
        self,
        *,
        last_automated_data_interval: DataInterval | None,
        restriction: TimeRestriction,
        now: dt.datetime,
    ) -> DagRunInfo | None:
        return None

    def infer_manual_data_interval(self, *, run_after: dt.datetime) -> DataInterval:
        return DataInterval.exact(_utc(run_after))


class OnceTimetable(NullTimetable):
    """``@once``: one run at the start date, whatever catchup says."""

    summary = ONCE
    can_be_scheduled = True

    def _serialize(self) -> dict[str, Any] | None:
        return {"type": "once"}

    def next_dagrun_info(
        self,
        *,
        last_automated_data_interval: DataInterval | None,
        restriction: TimeRestriction,
        now: dt.datetime,
    ) -> DagRunInfo | None:
        if last_automated_data_interval is not None or restriction.earliest is None:
            return None
        if restriction.latest is not None and restriction.earliest > restriction.latest:
            return None
        return DagRunInfo.exact(_utc(restriction.earliest))


class ContinuousTimetable(NullTimetable):
    """``@continuous``: a new run as soon as the previous one ends (needs max_active_runs=1);
    each run covers the time since the previous one was created."""

    summary = CONTINUOUS
    can_be_scheduled = True

    def _serialize(self) -> dict[str, Any] | None:
        return {"type": "continuous"}

    def next_dagrun_info(
        self,
        *,
        last_automated_data_interval: DataInterval | None,
        restriction: TimeRestriction,
        now: dt.datetime,
    ) -> DagRunInfo | None:
        if restriction.earliest is None:
            return None
        if last_automated_data_interval is not None:
            start, end = last_automated_data_interval.end, _utc(now)
        else:
            start = _utc(restriction.earliest)
            end = max(start, _utc(now))
        if restriction.latest is not None and end > restriction.latest:
            return None
        return DagRunInfo.interval(start, end)


class _DataIntervalTimetable(Timetable):
    """Periodic intervals; a run is created at the end of each one."""

    @abstractmethod
    def _get_next(self, current: dt.datetime) -> dt.datetime:
        """The first schedule point strictly after ``current``."""

    @abstractmethod
    def _get_prev(self, current: dt.datetime) -> dt.datetime:
        """The last schedule point strictly before ``current``."""

    @abstractmethod
    def _align_to_next(self, current: dt.datetime) -> dt.datetime:
        """``current`` if it is a schedule point, else the next one."""

    @abstractmethod
    def _align_to_prev(self, current: dt.datetime) -> dt.datetime:
        """``current`` if it is a schedule point, else the previous one."""

    @abstractmethod
    def _skip_to_latest(self, earliest: dt.datetime | None, now: dt.datetime) -> dt.datetime:
        """With catchup=False: the start of the latest interval that has ended by ``now``
        (never before ``earliest``)."""

    def next_dagrun_info(
        self,
        *,
        last_automated_data_interval: DataInterval | None,
        restriction: TimeRestriction,
        now: dt.datetime,
    ) -> DagRunInfo | None:
        earliest = restriction.earliest
        if not restriction.catchup:
            earliest = self._skip_to_latest(earliest, now)
        elif earliest is not None:
            earliest = self._align_to_next(earliest)
        if last_automated_data_interval is None:
            if earliest is None:
                return None
            start = earliest
        else:
            # Aligned again in case the schedule changed since the last run.
            start = self._align_to_prev(last_automated_data_interval.end)
            if earliest is not None:
                start = max(start, earliest)
        if restriction.latest is not None and start > restriction.latest:
            return None
        return DagRunInfo.interval(start, self._get_next(start))


class CronDataIntervalTimetable(_DataIntervalTimetable):
    """A cron expression (or preset) evaluated in ``timezone``.

    Schedules that fire at least every hour (hour field ``*``) step by absolute time, so the hour
    repeated when DST ends gets its runs too; others keep their wall-clock time, and a time that
    does not exist (skipped when DST starts) moves forward to the first one that does."""

    def __init__(self, expression: str, timezone: dt.tzinfo) -> None:
        self.summary = expression
        self._given = expression
        self._expression = CRON_PRESETS.get(expression, expression)
        self._timezone = timezone
        try:
            expanded = croniter(self._expression).expanded
        except (CroniterError, ValueError) as exc:
            raise InvalidSchedule(f"{expression!r} is not a cron expression: {exc}") from None
        self._every_hour = expanded[1] == ["*"]

    def __repr__(self) -> str:
        return f"CronDataIntervalTimetable({self.summary!r}, {self._timezone})"

    def _serialize(self) -> dict[str, Any] | None:
        zone = zone_name(self._timezone)
        if zone is None:
            return None
        return {"type": "cron", "expression": self._given, "timezone": zone}

    def _naive(self, current: dt.datetime) -> dt.datetime:
        return current.astimezone(self._timezone).replace(tzinfo=None)

    def _step(self, current: dt.datetime, forward: bool) -> dt.datetime:
        naive = self._naive(current)
        iterator = croniter(self._expression, naive)
        scheduled: dt.datetime = (
            iterator.get_next(dt.datetime) if forward else iterator.get_prev(dt.datetime)
        )
        if self._every_hour:
            return _utc(current) + (scheduled - naive)
        # fold=0: an ambiguous wall time is its first occurrence; a missing one moves forward.
        return _utc(scheduled.replace(tzinfo=self._timezone))

    def _get_next(self, current: dt.datetime) -> dt.datetime:
        return self._step(current, forward=True)

    def _get_prev(self, current: dt.datetime) -> dt.datetime:
        return self._step(current, forward=False)

    def _align_to_next(self, current: dt.datetime) -> dt.datetime:
        following = self._get_next(current)
        return current if self._get_prev(following) == current else following

    def _align_to_prev(self, current: dt.datetime) -> dt.datetime:
        previous = self._get_prev(current)
        return current if self._get_next(previous) == current else previous

    def _skip_to_latest(self, earliest: dt.datetime | None, now: dt.datetime) -> dt.datetime:
        last_start = self._get_prev(now)
        # On a boundary the interval ending now is the latest; between two, the one before.
        latest = last_start if self._get_next(last_start) == now else self._get_prev(last_start)
        return latest if earliest is None else max(latest, self._align_to_next(earliest))

    def infer_manual_data_interval(self, *, run_after: dt.datetime) -> DataInterval:
        # The last complete interval: a daily DAG triggered at 1am on the 25th covers the 24th.
        end = self._align_to_prev(run_after)
        return DataInterval(self._get_prev(end), end)


def _delta_seconds(delta: Delta) -> float:
    """The length of ``delta`` in seconds (months as 30 days, years as 365, as Airflow)."""
    if isinstance(delta, dt.timedelta):
        return delta.total_seconds()
    return (
        delta.years * 365 * 86400
        + delta.months * 30 * 86400
        + delta.days * 86400
        + delta.hours * 3600
        + delta.minutes * 60
        + delta.seconds
    )


# The fields of a relativedelta a delta schedule keeps (its absolute ones are not kept).
_RELATIVE_FIELDS = ("years", "months", "days", "hours", "minutes", "seconds", "microseconds")


class DeltaDataIntervalTimetable(_DataIntervalTimetable):
    """Intervals of a fixed ``timedelta`` (or ``relativedelta``) from the start date."""

    def __init__(self, delta: Delta) -> None:
        probe = dt.datetime(2000, 1, 1)
        if probe + delta <= probe:
            raise InvalidSchedule(f"a schedule interval must be positive, not {delta!r}")
        self._delta = delta
        self.summary = str(delta)

    def __repr__(self) -> str:
        return f"DeltaDataIntervalTimetable({self._delta!r})"

    def _serialize(self) -> dict[str, Any] | None:
        delta = self._delta
        if isinstance(delta, dt.timedelta):
            return {"type": "delta", "seconds": delta.total_seconds()}
        fields = {name: getattr(delta, name) for name in _RELATIVE_FIELDS}
        if relativedelta(**fields) != delta:  # absolute fields (a weekday, a month, ...)
            return None
        return {"type": "delta", "relativedelta": {k: v for k, v in fields.items() if v}}

    def _get_next(self, current: dt.datetime) -> dt.datetime:
        result: dt.datetime = _utc(current) + self._delta
        return result

    def _get_prev(self, current: dt.datetime) -> dt.datetime:
        result: dt.datetime = _utc(current) - self._delta
        return result

    def _align_to_next(self, current: dt.datetime) -> dt.datetime:
        return _utc(current)

    def _align_to_prev(self, current: dt.datetime) -> dt.datetime:
        return _utc(current)

    def _skip_to_latest(self, earliest: dt.datetime | None, now: dt.datetime) -> dt.datetime:
        # As Airflow 2: the latest complete interval is counted on the epoch grid of the delta,
        # not from the start date.
        seconds = now.timestamp()
        rounded = dt.datetime.fromtimestamp(seconds - seconds % _delta_seconds(self._delta), UTC)
        latest = self._get_prev(rounded)
        return latest if earliest is None else max(latest, _utc(earliest))

    def infer_manual_data_interval(self, *, run_after: dt.datetime) -> DataInterval:
        return DataInterval(self._get_prev(run_after), _utc(run_after))


def create_timetable(schedule: Any, timezone: dt.tzinfo) -> Timetable:
    """The timetable of a DAG's ``schedule`` (a Timetable is its own); raises InvalidSchedule
    saying what is wrong."""
    if isinstance(schedule, Timetable):
        return schedule
    if schedule is None:
        return NullTimetable()
    if isinstance(schedule, dt.timedelta | relativedelta):
        return DeltaDataIntervalTimetable(schedule)
    if not isinstance(schedule, str):
        raise InvalidSchedule(
            f"schedule must be a cron expression, a preset such as '@daily', a timedelta, a "
            f"Timetable or None, not {type(schedule).__name__}"
        )
    if schedule == ONCE:
        return OnceTimetable()
    if schedule == CONTINUOUS:
        return ContinuousTimetable()
    return CronDataIntervalTimetable(schedule, timezone)


def infos_between(
    timetable: Timetable, earliest: dt.datetime, latest: dt.datetime
) -> list[DagRunInfo]:
    """Every run whose logical date falls in [earliest, latest] (both included), as
    ``dags backfill`` creates them: the DAG's own start date, end date and catchup do not apply."""
    restriction = TimeRestriction(earliest, latest, catchup=True)
    infos: list[DagRunInfo] = []
    info = next_info(
        timetable, last_automated_data_interval=None, restriction=restriction, now=latest
    )
    while info is not None and (not infos or info.logical_date > infos[-1].logical_date):
        infos.append(info)
        info = next_info(
            timetable,
            last_automated_data_interval=info.data_interval,
            restriction=restriction,
            now=latest,
        )
    return infos
