"""Airflow 3.2+'s partitioned timetables (``airflow.sdk``): ``CronPartitionTimetable`` (a run
at each cron point, whose partition key is that point), ``PartitionedAssetTimetable`` (runs per
upstream partition key, by its mappers) and ``PartitionedAtRuntime`` (keys the tasks emit).

deferral runs a ``CronPartitionTimetable`` by its cron and gives each run its key; the
scheduler's asset pass makes a ``PartitionedAssetTimetable``'s runs, one per mapped key; a
``PartitionedAtRuntime`` DAG runs when triggered (docs/assets.md)."""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping, Sequence
from typing import Any

from deferral.assets import Asset, BaseAsset, asset_condition
from deferral.partitions import IdentityMapper, PartitionError, PartitionMapper
from deferral.timetables import InvalidSchedule, NullTimetable
from deferral.timetables.trigger import CronTriggerTimetable, zone


class CronPartitionTimetable(CronTriggerTimetable):
    """A run at each point of ``cron``; its partition key is the point (moved by
    ``run_offset`` points) formatted by ``key_format`` in ``timezone``."""

    partitioned = True

    def __init__(
        self,
        cron: str,
        *,
        timezone: str | dt.tzinfo,
        run_offset: int | None = None,
        key_format: str = "%Y-%m-%dT%H:%M:%S",
        run_immediately: bool | dt.timedelta = False,
    ) -> None:
        super().__init__(cron, timezone=timezone, run_immediately=run_immediately)
        if run_offset is not None and (
            not isinstance(run_offset, int) or isinstance(run_offset, bool)
        ):
            raise InvalidSchedule(f"run_offset must be an int, got {run_offset!r:.60}")
        if not isinstance(key_format, str) or not key_format:
            raise InvalidSchedule("key_format must be a non-empty strftime format")
        self._zone = zone(timezone)
        self.run_offset = run_offset or 0
        self.key_format = key_format
        self.description = f"partitions at each point of {cron!r}, in {timezone}"

    def __repr__(self) -> str:
        return f"CronPartitionTimetable({self.summary!r})"

    def _serialize(self) -> dict[str, Any] | None:
        data = super()._serialize()
        if data is None:
            return None
        extra = {"run_offset": self.run_offset, "key_format": self.key_format}
        return {**data, "type": "cron_partition", **extra}

    def partition_key(self, logical_date: dt.datetime) -> str:
        """The key of the run at ``logical_date``."""
        point = logical_date
        for _ in range(abs(self.run_offset)):
            point = (
                self._points._get_next(point)
                if self.run_offset > 0
                else self._points._get_prev(point)
            )
        return point.astimezone(self._zone).strftime(self.key_format)


class PartitionedAssetTimetable(NullTimetable):
    """Runs made per partition key of ``assets``' events, each asset's key mapped by its
    mapper in ``partition_mapper_config`` (by asset) or ``default_partition_mapper``."""

    partitioned = True

    def __init__(
        self,
        *,
        assets: BaseAsset | Sequence[BaseAsset],
        partition_mapper_config: Mapping[BaseAsset, PartitionMapper] | None = None,
        default_partition_mapper: PartitionMapper | None = None,
    ) -> None:
        self.condition = asset_condition("PartitionedAssetTimetable", assets)
        named = {asset.name for asset in self.condition.iter_assets()}
        self.mappers: dict[str, PartitionMapper] = {}
        for asset, mapper in (partition_mapper_config or {}).items():
            if not isinstance(asset, Asset):
                raise PartitionError(
                    f"partition_mapper_config keys must be assets, got {type(asset).__name__}"
                )
            if asset.name not in named:
                raise PartitionError(
                    f"partition_mapper_config names asset {asset.name!r}, not one of the schedule's"
                )
            if not isinstance(mapper, PartitionMapper):
                raise PartitionError(
                    f"partition mapper of asset {asset.name!r} must be a PartitionMapper, "
                    f"got {type(mapper).__name__}"
                )
            self.mappers[asset.name] = mapper
        default = default_partition_mapper or IdentityMapper()
        if not isinstance(default, PartitionMapper):
            raise PartitionError(
                f"default_partition_mapper must be a PartitionMapper, got {type(default).__name__}"
            )
        self.default_partition_mapper = default
        self.summary = f"partitions of {self.condition.summary()}"
        self.description = f"Triggered by partitions of {self.condition.summary()}"

    def mapper_of(self, asset_name: str) -> PartitionMapper:
        return self.mappers.get(asset_name, self.default_partition_mapper)

    def _serialize(self) -> dict[str, Any] | None:
        # Made again as timetables.serialized.StoredAssetSchedule (no clock): its mappers are
        # the scheduler's, which has the DAG's objects.
        return {"type": "asset", "summary": self.summary, "timetable": None, "partitioned": True}


# As Airflow's dag_run.partition_key column.
MAX_PARTITION_KEY_LENGTH = 250


def partition_key_error(dag_id: str, timetable: object, key: object) -> str | None:
    """Why a run of ``dag_id`` (scheduled by ``timetable``) cannot be triggered with partition
    key ``key``, as Airflow's ``validate_partition_key``: its DAG must be partitioned (ahead of
    the run or at run time), the key a non-blank string of at most 250 characters, and a
    ``CronPartitionTimetable``'s key one its ``key_format`` reads. None: it can."""
    if not (
        getattr(timetable, "partitioned", False)
        or getattr(timetable, "partitioned_at_runtime", False)
    ):
        return (
            f"DAG {dag_id!r} is not partitioned: a partition key needs a CronPartitionTimetable,"
            " PartitionedAssetTimetable or PartitionedAtRuntime schedule"
        )
    if not isinstance(key, str) or not key.strip() or len(key) > MAX_PARTITION_KEY_LENGTH:
        return (
            f"DAG {dag_id!r}: a partition key is a non-blank string of at most"
            f" {MAX_PARTITION_KEY_LENGTH} characters, got {key!r}"
        )
    if isinstance(timetable, CronPartitionTimetable):
        try:
            dt.datetime.strptime(key, timetable.key_format)
        except ValueError:
            return (
                f"DAG {dag_id!r}: partition key {key!r} does not match its key format"
                f" {timetable.key_format!r}"
            )
    return None


class PartitionedAtRuntime(NullTimetable):
    """As Airflow's: no run by the clock (runs are triggered, with a partition key of any form
    or none); the tasks name the partitions they write
    (``outlet_events[asset].add_partitions(...)``), each key an event of its own, and a
    ``PartitionedAssetTimetable`` DAG on those assets gets one run per mapped key."""

    partitioned_at_runtime = True
    summary = "partitioned at runtime"

    def _serialize(self) -> dict[str, Any] | None:
        return {"type": "partitioned_at_runtime"}
