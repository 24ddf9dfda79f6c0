"""Airflow 3.2+'s asset partitions as authored: mappers map keys as Airflow's do, bad mappers,
windows, keys and timetables are one-line errors, a CronPartitionTimetable's run has the key of
its point, ``Asset.ref`` and ``@asset``."""

from __future__ import annotations

import datetime as dt

import pytest

from deferral import DAG
from deferral.assets import Asset, AssetError, OutletEventAccessors
from deferral.context import DagRunInfo, with_partition
from deferral.dag import collecting_dags
from deferral.decorators.asset import AssetOperator, asset
from deferral.exceptions import DagDefinitionError
from deferral.partitions import (
    AllowedKeyMapper,
    ChainMapper,
    DayWindow,
    FanOutMapper,
    FixedKeyMapper,
    IdentityMapper,
    MinimumCount,
    MonthWindow,
    PartitionError,
    ProductMapper,
    RollupMapper,
    SegmentWindow,
    StartOfDayMapper,
    StartOfHourMapper,
    StartOfMonthMapper,
    StartOfQuarterMapper,
    StartOfWeekMapper,
    StartOfYearMapper,
    WaitForAll,
    WeekWindow,
)
from deferral.timetables import InvalidSchedule
from deferral.timetables.partitions import (
    CronPartitionTimetable,
    PartitionedAssetTimetable,
    PartitionedAtRuntime,
)

KEY = "2024-03-13T10:42:15"


@pytest.mark.parametrize(
    ("mapper", "key", "mapped"),
    [
        (IdentityMapper(), "us", "us"),
        (AllowedKeyMapper(["us", "eu"]), "eu", "eu"),
        (FixedKeyMapper("all"), "us", "all"),
        (StartOfHourMapper(), KEY, "2024-03-13T10"),
        (StartOfDayMapper(), KEY, "2024-03-13"),
        (StartOfWeekMapper(), KEY, "2024-03-11 (W11)"),
        (StartOfMonthMapper(), KEY, "2024-03"),
        (StartOfQuarterMapper(), KEY, "2024-Q1"),
        (StartOfYearMapper(), KEY, "2024"),
        (StartOfMonthMapper(input_format="%Y-%m-%d"), "2024-01-31", "2024-01"),
        (StartOfDayMapper(timezone="Asia/Tokyo"), "2024-03-13T23:00:00", "2024-03-13"),
        (ProductMapper(IdentityMapper(), StartOfDayMapper()), f"us|{KEY}", "us|2024-03-13"),
        (ChainMapper(StartOfDayMapper(), AllowedKeyMapper(["2024-03-13"])), KEY, "2024-03-13"),
        (RollupMapper(upstream_mapper=StartOfDayMapper(), window=DayWindow()), KEY, "2024-03-13"),
        (
            FanOutMapper(
                upstream_mapper=IdentityMapper(),
                window=SegmentWindow(["us", "eu"]),
                downstream_mapper=IdentityMapper(),
            ),
            "x",
            ["us", "eu"],
        ),
    ],
)
def test_mappers_map_keys_as_airflows(mapper: object, key: str, mapped: object) -> None:
    assert mapper.to_downstream(key) == mapped  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("mapper", "key", "message"),
    [
        (AllowedKeyMapper(["us"]), "apac", "'apac' is not one of ['us']"),
        (StartOfDayMapper(), "us", "'us' does not match '%Y-%m-%dT%H:%M:%S'"),
        (ProductMapper(IdentityMapper(), IdentityMapper()), "a|b|c", "has 3 parts"),
    ],
)
def test_a_key_a_mapper_cannot_map_is_a_value_error(mapper: object, key: str, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        mapper.to_downstream(key)  # type: ignore[attr-defined]


def test_bad_mappers_windows_and_policies_are_one_line_errors() -> None:
    cases = [
        (lambda: AllowedKeyMapper([]), "AllowedKeyMapper takes a non-empty list of keys"),
        (lambda: FixedKeyMapper(""), "FixedKeyMapper key must be a non-empty string"),
        (lambda: ProductMapper(IdentityMapper()), "ProductMapper takes at least two mappers"),
        (lambda: ProductMapper(IdentityMapper(), "x"), "must be a PartitionMapper, got str"),
        (lambda: SegmentWindow([]), "SegmentWindow takes a non-empty list of keys"),
        (lambda: MinimumCount(0), "MinimumCount takes a non-zero int, got 0"),
        (
            lambda: FanOutMapper(upstream_mapper=IdentityMapper(), window=SegmentWindow(["a"])),
            "FanOutMapper has no default downstream_mapper for SegmentWindow",
        ),
        (
            lambda: RollupMapper(upstream_mapper=IdentityMapper(), window="day"),
            "RollupMapper window must be a Window, got str",
        ),
        (lambda: WeekWindow(direction="back"), "direction must be a Window.Direction"),
    ]
    for make, message in cases:
        with pytest.raises(PartitionError, match=message):
            make()


def test_wait_policies_count_the_members_that_arrived() -> None:
    assert WaitForAll().is_satisfied(3, 3) and not WaitForAll().is_satisfied(2, 3)
    assert MinimumCount(2).is_satisfied(2, 3) and not MinimumCount(2).is_satisfied(1, 3)
    assert MinimumCount(-1).is_satisfied(2, 3) and not MinimumCount(-1).is_satisfied(1, 3)
    fan_out = FanOutMapper(upstream_mapper=StartOfWeekMapper(), window=WeekWindow())
    assert isinstance(fan_out.downstream_mapper, StartOfDayMapper)


def test_a_rollup_waits_for_its_windows_members() -> None:
    month = RollupMapper(
        upstream_mapper=StartOfMonthMapper(input_format="%Y-%m-%d"), window=MonthWindow()
    )
    assert len(month.to_upstream("2024-02")) == 29 and len(month.to_upstream("2023-02")) == 28
    days = {f"2024-04-{d:02d}" for d in range(1, 31)}
    assert month.complete("2024-04", days) and not month.complete("2024-04", days - {"2024-04-30"})
    # Only the window's own members count: a day of another month does not stand in for one.
    assert not month.complete("2024-04", days - {"2024-04-30"} | {"2024-05-01"})
    regions = RollupMapper(
        upstream_mapper=FixedKeyMapper("all"),
        window=SegmentWindow(["us", "eu", "apac"]),
        wait_policy=MinimumCount(2),
    )
    assert not regions.complete("all", {"us"}) and regions.complete("all", {"us", "eu"})
    with pytest.raises(ValueError, match=r"partition key 'xx' is not one of the window's segments"):
        regions.to_downstream("xx")
    unreachable = RollupMapper(
        upstream_mapper=FixedKeyMapper("all"),
        window=SegmentWindow(["us", "eu"]),
        wait_policy=MinimumCount(3),
    )
    with pytest.raises(ValueError) as held:
        unreachable.complete("all", {"us", "eu"})
    assert str(held.value) == (
        "wait policy MinimumCount(3) can never be satisfied given the window's cardinality 2"
    )


def test_a_cron_partition_run_has_the_key_of_its_point() -> None:
    timetable = CronPartitionTimetable("0 * * * *", timezone="UTC")
    point = dt.datetime(2024, 3, 13, 10, tzinfo=dt.UTC)
    assert timetable.partition_key(point) == "2024-03-13T10:00:00"
    offset = CronPartitionTimetable("0 * * * *", timezone="UTC", run_offset=-1, key_format="%H")
    assert offset.partition_key(point) == "09"
    run = with_partition(DagRunInfo("d", "r", point), timetable)
    assert (run.partition_key, run.partition_date) == ("2024-03-13T10:00:00", point)
    assert with_partition(DagRunInfo("d", "r", point), PartitionedAtRuntime()).partition_key is None
    with pytest.raises(InvalidSchedule, match="run_offset must be an int, got '1h'"):
        CronPartitionTimetable("0 * * * *", timezone="UTC", run_offset="1h")  # type: ignore[arg-type]
    # Like CronTriggerTimetable, it needs no start_date: its first run is the next point.
    dag = DAG("hourly_partitions", schedule=timetable)
    now = dt.datetime(2026, 6, 14, 3, 30, tzinfo=dt.UTC)
    info = dag.next_dagrun_info(None, now=now)
    assert dag.start_date is None and info is not None
    assert info.data_interval.end == dt.datetime(2026, 6, 14, 4, tzinfo=dt.UTC)


def test_a_partitioned_asset_timetable_makes_no_run_by_the_clock() -> None:
    a, b = Asset("a"), Asset("b")
    timetable = PartitionedAssetTimetable(
        assets=a & Asset.ref(name="b"), partition_mapper_config={a: StartOfDayMapper()}
    )
    assert not timetable.can_be_scheduled and timetable.summary == "partitions of a & b"
    assert isinstance(timetable.mapper_of("a"), StartOfDayMapper)
    assert isinstance(timetable.mapper_of("b"), IdentityMapper)
    dag = DAG("consumer", schedule=timetable)
    # Its runs are made by the scheduler's asset pass, one per mapped key, not by the clock.
    assert dag.asset_condition is timetable.condition and dag.timetable is timetable
    with pytest.raises(PartitionError, match="names asset 'c', not one of the schedule's"):
        PartitionedAssetTimetable(
            assets=[a, b], partition_mapper_config={Asset("c"): IdentityMapper()}
        )


def test_asset_refs_name_an_asset_defined_elsewhere() -> None:
    ref = Asset.ref(name="x")
    assert ref == Asset("x", uri="s3://x") and ref.is_ref and repr(ref) == "Asset.ref(name='x')"
    with pytest.raises(AssetError, match="deferral knows assets by name"):
        Asset.ref(uri="s3://x")
    with pytest.raises(AssetError, match=r"Asset\.ref takes a name or a uri, not both"):
        Asset.ref(name="x", uri="s3://x")


def test_add_partitions_checks_its_keys() -> None:
    events = OutletEventAccessors([Asset("a")])
    events["a"].add_partitions(["us", "eu", "us"])
    events["a"].add_partitions("ap")
    # The added keys, else the run's key, make the events (one each) of the task's outlets.
    assert events.partitions("2024-05-06") == {"a": ["us", "eu", "ap"]}
    assert OutletEventAccessors([Asset("a"), Asset("b")]).partitions("k") == {
        "a": ["k"],
        "b": ["k"],
    }
    assert OutletEventAccessors([Asset("a")]).partitions(None) == {}
    with pytest.raises(AssetError, match="needs at least one key"):
        events["a"].add_partitions([])
    with pytest.raises(PartitionError, match="partition key must be a non-empty string"):
        events["a"].add_partitions(" ")


def test_the_asset_decorator_makes_a_dag_that_updates_the_asset() -> None:
    with collecting_dags() as collected:

        @asset(uri="s3://bucket/report", schedule=None, tags=["t"])
        def report(self: Asset, context: object, source: Asset, limit: int = 3) -> None:
            pass

    ((dag, _),) = collected
    assert report == Asset("report") and report.uri == "s3://bucket/report"
    task = dag.get_task("report")
    assert dag.dag_id == "report" and isinstance(task, AssetOperator)
    assert task.outlets == [report] and task.inlets == [Asset.ref(name="source")]
    with pytest.raises(DagDefinitionError, match=r"@asset 'bad': @asset takes no \*args"):

        @asset(schedule=None)
        def bad(*args: object) -> None:
            pass
