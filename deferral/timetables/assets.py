"""Airflow 3's ``airflow.timetables.assets.AssetOrTimeSchedule``: a DAG run by the clock (its
``timetable``) and also by asset events (``assets``, a condition or a list meaning all)."""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from typing import Any

from deferral.assets import BaseAsset, asset_condition
from deferral.timetables import (
    DagRunInfo,
    DataInterval,
    TimeRestriction,
    Timetable,
    manual_interval,
    next_info,
)


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

    def _serialize(self) -> dict[str, Any] | None:
        clock = self.timetable.serialize()
        if clock is None:
            return None
        return {"type": "asset_or_time", "summary": self.summary, "timetable": clock}
