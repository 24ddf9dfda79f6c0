"""Each built-in timetable as a typed dict and back (the DAG's document keeps it, so a trigger
computes a manual run's interval without the DAG file); a DAG file's own class is not kept."""

from __future__ import annotations

import datetime as dt
import zoneinfo

import pytest
from dateutil.relativedelta import relativedelta

from deferral.assets import Asset, AssetTriggeredTimetable
from deferral.timetables import (
    ContinuousTimetable,
    CronDataIntervalTimetable,
    DeltaDataIntervalTimetable,
    InvalidSchedule,
    NullTimetable,
    OnceTimetable,
    Timetable,
)
from deferral.timetables.assets import AssetOrTimeSchedule
from deferral.timetables.partitions import (
    CronPartitionTimetable,
    PartitionedAssetTimetable,
    PartitionedAtRuntime,
)
from deferral.timetables.serialized import deserialize_timetable
from deferral.timetables.trigger import CronTriggerTimetable

PARIS = zoneinfo.ZoneInfo("Europe/Paris")
BUILT_IN: list[Timetable] = [
    NullTimetable(),
    OnceTimetable(),
    ContinuousTimetable(),
    CronDataIntervalTimetable("@daily", PARIS),
    DeltaDataIntervalTimetable(dt.timedelta(hours=3)),
    DeltaDataIntervalTimetable(relativedelta(months=1)),
    CronTriggerTimetable("0 2 * * *", timezone="UTC", interval=dt.timedelta(hours=1)),
    CronTriggerTimetable("0 2 * * *", timezone=PARIS, run_immediately=dt.timedelta(minutes=5)),
    AssetTriggeredTimetable(Asset("s3://a")),
    AssetOrTimeSchedule(timetable=CronDataIntervalTimetable("@hourly", PARIS), assets=[Asset("b")]),
    CronPartitionTimetable("0 * * * *", timezone="UTC", run_offset=-1, key_format="%Y%m%d%H"),
    PartitionedAssetTimetable(assets=[Asset("c")]),
    PartitionedAtRuntime(),
]


@pytest.mark.parametrize(
    "timetable",
    BUILT_IN,
    # Stable across the lanes of a run (a default repr names the object's address).
    ids=[f"{i}-{type(t).__name__}" for i, t in enumerate(BUILT_IN)],
)
def test_a_built_in_timetable_round_trips(timetable: Timetable) -> None:
    data = timetable.serialize()
    assert data is not None and isinstance(data["type"], str)
    again = deserialize_timetable(data)
    assert again.serialize() == data
    assert again.summary == timetable.summary
    assert again.can_be_scheduled == timetable.can_be_scheduled
    for at in (
        dt.datetime(2024, 3, 5, 10, 30, tzinfo=dt.UTC),
        dt.datetime(2024, 3, 31, 1, tzinfo=dt.UTC),
    ):
        wanted = timetable.infer_manual_data_interval(run_after=at)
        assert again.infer_manual_data_interval(run_after=at) == wanted


class Fridays(CronDataIntervalTimetable):
    """A DAG file's own class, even a subclass of a built-in one."""


def test_a_dag_files_own_timetable_and_an_unnamed_zone_are_not_kept() -> None:
    assert Fridays("0 0 * * 5", PARIS).serialize() is None
    fixed = dt.timezone(dt.timedelta(hours=2))
    assert CronDataIntervalTimetable("@daily", fixed).serialize() is None
    assert DeltaDataIntervalTimetable(relativedelta(weekday=0, days=7)).serialize() is None


def test_an_unknown_kind_is_named() -> None:
    with pytest.raises(InvalidSchedule, match="no timetable of kind 'lunar'"):
        deserialize_timetable({"type": "lunar"})
