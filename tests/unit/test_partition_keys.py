"""Which runs may be triggered with a partition key (``partition_key_error``, pure), and the
timetables' partition flags as Airflow's: ``partitioned`` ahead of the run, or
``partitioned_at_runtime``."""

from __future__ import annotations

import pytest

from deferral.assets import Asset
from deferral.timetables import NullTimetable
from deferral.timetables.partitions import (
    CronPartitionTimetable,
    PartitionedAssetTimetable,
    PartitionedAtRuntime,
    partition_key_error,
)
from deferral.timetables.serialized import deserialize_timetable

CRON = CronPartitionTimetable("0 0 * * *", timezone="UTC", key_format="%Y-%m-%d")


def test_the_flags_are_airflows() -> None:
    runtime = PartitionedAtRuntime()
    assert (runtime.partitioned, runtime.partitioned_at_runtime) == (False, True)
    assert not runtime.can_be_scheduled
    assert (CRON.partitioned, CRON.partitioned_at_runtime) == (True, False)
    assets = PartitionedAssetTimetable(assets=Asset("a"))
    assert assets.partitioned
    assert not NullTimetable().partitioned and not NullTimetable().partitioned_at_runtime


def test_a_parsed_document_keeps_whether_an_asset_schedule_is_partitioned() -> None:
    partitioned = PartitionedAssetTimetable(assets=Asset("a")).serialize()
    assert partitioned is not None and deserialize_timetable(partitioned).partitioned
    runtime = PartitionedAtRuntime().serialize()
    assert runtime is not None and deserialize_timetable(runtime).partitioned_at_runtime


@pytest.mark.parametrize(
    "timetable", [PartitionedAtRuntime(), PartitionedAssetTimetable(assets=Asset("a"))]
)
def test_any_non_blank_key_is_taken_by_a_runtime_or_asset_partitioned_dag(
    timetable: object,
) -> None:
    assert partition_key_error("d", timetable, "ACCT00012345") is None
    assert partition_key_error("d", timetable, "x" * 250) is None


@pytest.mark.parametrize(
    ("timetable", "key", "message"),
    [
        (
            NullTimetable(),
            "k",
            "DAG 'd' is not partitioned: a partition key needs a CronPartitionTimetable,"
            " PartitionedAssetTimetable or PartitionedAtRuntime schedule",
        ),
        (
            PartitionedAtRuntime(),
            "  ",
            "DAG 'd': a partition key is a non-blank string of at most 250 characters, got '  '",
        ),
        (
            PartitionedAtRuntime(),
            "x" * 251,
            f"DAG 'd': a partition key is a non-blank string of at most 250 characters,"
            f" got {'x' * 251!r}",
        ),
        (
            CRON,
            "not-a-date",
            "DAG 'd': partition key 'not-a-date' does not match its key format '%Y-%m-%d'",
        ),
    ],
)
def test_a_key_a_dag_cannot_take_is_refused_naming_the_dag(
    timetable: object, key: str, message: str
) -> None:
    assert partition_key_error("d", timetable, key) == message


def test_a_cron_partitioned_dag_takes_a_key_its_format_reads() -> None:
    assert partition_key_error("d", CRON, "2024-05-06") is None
