"""A timetable made again from the typed dict its ``serialize()`` gave (Airflow's
``Timetable.deserialize``): a DAG's document keeps its timetable so, and a trigger computes a
manual run's data interval from it without importing the DAG file. Each built-in kind is here;
a DAG file's own class serializes to None (readmodel/DECISIONS.md 7)."""

from __future__ import annotations

import datetime as dt
import zoneinfo
from collections.abc import Callable, Mapping
from typing import Any

from dateutil.relativedelta import relativedelta

from deferral.timetables import (
    ContinuousTimetable,
    CronDataIntervalTimetable,
    DagRunInfo,
    DataInterval,
    DeltaDataIntervalTimetable,
    InvalidSchedule,
    NullTimetable,
    OnceTimetable,
    TimeRestriction,
    Timetable,
    manual_interval,
    next_info,
)
from deferral.timetables.partitions import CronPartitionTimetable, PartitionedAtRuntime
from deferral.timetables.trigger import CronTriggerTimetable
from deferral.timetables.workday import AfterWorkdayTimetable


class StoredAssetSchedule(Timetable):
    """An asset schedule as a DAG's document keeps it: its condition as its summary only, and
    its clock (a timetable; none: asset events only). What reads a document (a trigger's manual
    interval, a backfill's intervals) needs no more; the scheduler, which makes the runs of
    asset events, has the DAG's objects."""

    def __init__(
        self, kind: str, summary: str, clock: Timetable | None, partitioned: bool = False
    ) -> None:
        self.kind = kind
        self.summary = summary
        self.clock = clock
        self.partitioned = partitioned
        self.can_be_scheduled = clock is not None and clock.can_be_scheduled

    def next_dagrun_info(
        self,
        *,
        last_automated_data_interval: DataInterval | None,
        restriction: TimeRestriction,
        now: dt.datetime,
    ) -> DagRunInfo | None:
        if self.clock is None:
            return None
        return next_info(
            self.clock,
            last_automated_data_interval=last_automated_data_interval,
            restriction=restriction,
            now=now,
        )

    def infer_manual_data_interval(self, *, run_after: dt.datetime) -> DataInterval:
        if self.clock is None:
            return DataInterval.exact(run_after.astimezone(dt.UTC))
        return manual_interval(self.clock, run_after)

    def _serialize(self) -> dict[str, Any] | None:
        clock = self.clock.serialize() if self.clock is not None else None
        kept = {"type": self.kind, "summary": self.summary, "timetable": clock}
        return {**kept, "partitioned": True} if self.partitioned else kept


def _asset(data: Mapping[str, Any]) -> Timetable:
    clock = data.get("timetable")
    return StoredAssetSchedule(
        data["type"],
        data["summary"],
        deserialize_timetable(clock) if clock else None,
        bool(data.get("partitioned", False)),
    )


def _delta(data: Mapping[str, Any]) -> Timetable:
    if "relativedelta" in data:
        return DeltaDataIntervalTimetable(relativedelta(**data["relativedelta"]))
    return DeltaDataIntervalTimetable(dt.timedelta(seconds=data["seconds"]))


def _run_immediately(data: Mapping[str, Any]) -> bool | dt.timedelta:
    within = data.get("run_immediately_within")
    return dt.timedelta(seconds=within) if within is not None else bool(data["run_immediately"])


def _cron_trigger(data: Mapping[str, Any]) -> Timetable:
    return CronTriggerTimetable(
        data["cron"],
        timezone=data["timezone"],
        interval=dt.timedelta(seconds=data["interval"]),
        run_immediately=_run_immediately(data),
    )


def _cron_partition(data: Mapping[str, Any]) -> Timetable:
    return CronPartitionTimetable(
        data["cron"],
        timezone=data["timezone"],
        run_offset=data["run_offset"],
        key_format=data["key_format"],
        run_immediately=_run_immediately(data),
    )


# Each kind's maker, by the "type" of its dict.
DESERIALIZERS: dict[str, Callable[[Mapping[str, Any]], Timetable]] = {
    "null": lambda data: NullTimetable(),
    "once": lambda data: OnceTimetable(),
    "continuous": lambda data: ContinuousTimetable(),
    "cron": lambda data: CronDataIntervalTimetable(
        data["expression"], zoneinfo.ZoneInfo(data["timezone"])
    ),
    "delta": _delta,
    "cron_trigger": _cron_trigger,
    "cron_partition": _cron_partition,
    "partitioned_at_runtime": lambda data: PartitionedAtRuntime(),
    "asset": _asset,
    "asset_or_time": _asset,
    "after_workday": lambda data: AfterWorkdayTimetable(),
}


def deserialize_timetable(data: Mapping[str, Any]) -> Timetable:
    """The timetable whose ``serialize()`` gave ``data``; InvalidSchedule naming an unknown
    kind."""
    make = DESERIALIZERS.get(str(data.get("type")))
    if make is None:
        raise InvalidSchedule(f"no timetable of kind {data.get('type')!r:.60}")
    return make(data)
