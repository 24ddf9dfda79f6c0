"""After each parse: what the asset tables say of the parsed DAGs (the assets they name, which
DAGs are scheduled on which assets, which tasks update which, the watchers to run); and the
asset-triggered runs, made from the events queued for each DAG."""

from __future__ import annotations

import datetime as dt
import logging
from collections.abc import Mapping

from sqlalchemy import delete, tuple_
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.orm import Session

from deferral.assets import Asset, BaseAsset, watchers_of
from deferral.dag import DAG
from deferral.runtime.crypto import Cipher, Purpose
from deferral.store.assets import record_assets
from deferral.store.tables import AssetWatcherRow, DagScheduleAsset, TaskOutletAsset
from deferral.store.transitions.assets import create_asset_runs, create_partition_runs
from deferral.timetables.partitions import PartitionedAssetTimetable

log = logging.getLogger("deferral.scheduler")

# Asset-triggered runs one DAG gets per call (more wait for the next loop).
RUNS_PER_DAG_PER_CALL = 500


def named_assets(dags: Mapping[str, DAG]) -> list[Asset]:
    """The assets ``dags`` name in their schedules, inlets and outlets, each once, in DAG-id
    order (the order in which they take their URIs: deferral/store/assets.py)."""
    assets: dict[str, Asset] = {}
    for _, dag in sorted(dags.items()):
        condition = dag.asset_condition
        named = [
            *(condition.iter_assets() if condition is not None else ()),
            *(a for task in dag.tasks for a in getattr(task, "inlets", None) or ()),
            *(a for task in dag.tasks for a in getattr(task, "outlets", None) or ()),
        ]
        for asset in named:
            # A reference's uri is not known here; an alias's events are its task's to add.
            if isinstance(asset, Asset) and not asset.is_ref:
                assets.setdefault(asset.name, asset)
    return list(assets.values())


def sync_assets(
    session: Session, dags: Mapping[str, DAG], cipher: Cipher, *, whole_folder: bool = False
) -> None:
    """Record the assets (``named_assets``), schedules, outlets and watchers of the parsed
    ``dags`` (rows of DAGs no longer parsed are kept until they are: a file broken for a
    moment keeps its watchers' rows, which run only while the DAG is active). ``whole_folder``:
    ``dags`` are every DAG of the folder, none of its files failing to import (an asset none
    of them names gives up its URI: ``record_assets(every_named=)``)."""
    schedules: set[tuple[str, ...]] = set()
    outlets: set[tuple[str, ...]] = set()
    watchers: list[dict[str, str]] = []
    for dag_id, dag in sorted(dags.items()):
        condition = dag.asset_condition
        # An alias is scheduled on by its key (AssetAlias.key), beside the assets' names.
        for key in condition.iter_keys() if condition is not None else ():
            schedules.add((dag_id, key))
        for task in dag.tasks:
            for asset in getattr(task, "outlets", None) or ():
                if isinstance(asset, Asset):
                    outlets.add((dag_id, task.task_id, asset.name))
        for asset, watcher in watchers_of(condition):
            classpath, kwargs = watcher.trigger.serialize()
            watchers.append(
                {
                    "dag_id": dag_id,
                    "asset_name": asset.name,
                    "name": watcher.name,
                    "classpath": classpath,
                    "kwargs": cipher.seal(
                        Purpose.WATCHER_SPEC,
                        {"classpath": classpath, "kwargs": kwargs},
                        "watcher kwargs",
                    ),
                }
            )
    parsed = sorted(dags)
    record_assets(session, named_assets(dags), every_named=whole_folder)
    _replace(session, DagScheduleAsset, parsed, schedules, ("dag_id", "asset_name"))
    _replace(session, TaskOutletAsset, parsed, outlets, ("dag_id", "task_id", "asset_name"))
    keep = {(w["dag_id"], w["asset_name"], w["name"]) for w in watchers}
    session.execute(
        delete(AssetWatcherRow).where(
            AssetWatcherRow.dag_id.in_(parsed),
            tuple_(AssetWatcherRow.dag_id, AssetWatcherRow.asset_name, AssetWatcherRow.name).not_in(
                sorted(keep) or [("", "", "")]
            ),
        )
    )
    if watchers:
        statement = insert(AssetWatcherRow).values(watchers)
        # A watcher whose trigger changed keeps its lease: its triggerer restarts it.
        session.execute(
            statement.on_conflict_do_update(
                index_elements=["dag_id", "asset_name", "name"],
                set_={
                    "classpath": statement.excluded.classpath,
                    "kwargs": statement.excluded.kwargs,
                },
            )
        )


def _replace(
    session: Session,
    model: type[DagScheduleAsset] | type[TaskOutletAsset],
    parsed: list[str],
    rows: set[tuple[str, ...]],
    columns: tuple[str, ...],
) -> None:
    """The rows of ``model`` for the parsed DAGs become ``rows``."""
    keys = tuple_(*(getattr(model, c) for c in columns))
    session.execute(
        delete(model).where(
            model.dag_id.in_(parsed), keys.not_in(sorted(rows) or [("",) * len(columns)])
        )
    )
    if rows:
        session.execute(
            insert(model)
            .values([dict(zip(columns, row, strict=True)) for row in sorted(rows)])
            .on_conflict_do_nothing()
        )


def create_runs(session: Session, dags: Mapping[str, DAG], now: dt.datetime) -> None:
    """The runs the queued asset events make: one per set of events that satisfies a DAG's
    condition, or one per partition key of a DAG scheduled on assets' partitions."""
    conditions: dict[str, BaseAsset] = {}
    partitioned: dict[str, PartitionedAssetTimetable] = {}
    for dag_id, dag in dags.items():
        if isinstance(dag.timetable, PartitionedAssetTimetable):
            partitioned[dag_id] = dag.timetable
        elif dag.asset_condition is not None:
            conditions[dag_id] = dag.asset_condition
    for dag_id, run_id in [
        *create_asset_runs(session, conditions, now, RUNS_PER_DAG_PER_CALL),
        *create_partition_runs(session, partitioned, now, RUNS_PER_DAG_PER_CALL),
    ]:
        log.info("created run %s of DAG %s from asset events", run_id, dag_id)
