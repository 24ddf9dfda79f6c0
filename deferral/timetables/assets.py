"""Airflow 3's ``airflow.timetables.assets.AssetOrTimeSchedule``: a DAG run by the clock (its
``timetable``) and also by asset events (``assets``, a condition or a list meaning all)."""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping, Sequence
from typing import Any

from deferral.assets import AssetTriggeredTimetable, BaseAsset, asset_condition
from deferral.timetables import (
    DagRunInfo,
    DataInterval,
    TimeRestriction,
    Timetable,
    deserialize_timetable,
    manual_interval,
    next_info,
    serializable,
    serialize_timetable,
)


def _stored(data: Mapping[str, Any]) -> Timetable:
    clock = data.get("timetable")
    return StoredAssetSchedule(
        data["type"], data["summary"], deserialize_timetable(clock) if clock else None
    )


@serializable("asset", "asset_or_time", make=_stored)
class StoredAssetSchedule(Timetable):
    """An asset schedule as a DAG's document keeps it: its condition as its summary only, and
    its clock (a timetable; none: asset events only). What reads a document (a trigger's manual
    interval, the next run by the clock) needs no more; the scheduler, which makes the runs of
    asset events, has the DAG's objects."""

    def __init__(self, kind: str, summary: str, clock: Timetable | None) -> None:
        self.kind = kind
        self.summary = summary
        self.clock = clock
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

    def serialize(self) -> dict[str, Any] | None:
        clock = serialize_timetable(self.clock) if self.clock is not None else None
        if self.clock is not None and clock is None:
            return None
        return {"type": self.kind, "summary": self.summary, "timetable": clock}


# A DAG scheduled on assets alone: its condition is kept as its summary.
serializable("asset", make=_stored)(AssetTriggeredTimetable)


@serializable("asset_or_time", make=_stored)
class AssetOrTimeSchedule(Timetable):
    def __init__(self, *, timetable: Timetable, assets: BaseAsset | Sequence[BaseAsset]) -> None:
        if not isinstance(timetable, Timetable):
            raise TypeError(f"timetable must be a Timetable, got {type(timetable).__name__}")
        self.timetable = timetable
        self.condition = asset_condition("AssetOrTimeSchedule", assets)
        self.can_be_scheduled = timetable.can_be_scheduled
        self.summary = f"{self.condition.summary()} or {timetable.summary}"
        self.description = f"Triggered by assets or {timetable.description or timetable.summary}"

    def next_dagrun_info(
        self,
        *,
        last_automated_data_interval: DataInterval | None,
        restriction: TimeRestriction,
        now: dt.datetime,
    ) -> DagRunInfo | None:
        return next_info(
            self.timetable,
            last_automated_data_interval=last_automated_data_interval,
            restriction=restriction,
            now=now,
        )

    def infer_manual_data_interval(self, *, run_after: dt.datetime) -> DataInterval:
        return manual_interval(self.timetable, run_after)

    def serialize(self) -> dict[str, Any] | None:
        return StoredAssetSchedule("asset_or_time", self.summary, self.timetable).serialize()
