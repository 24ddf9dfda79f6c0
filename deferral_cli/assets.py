"""``deferral assets``: the assets the parsed DAGs name, who updates and who waits for each, their
watchers, and their recent events."""

from __future__ import annotations

from collections import defaultdict

import click
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from deferral.runtime.process import command_group, settings_or_exit
from deferral.store.tables import (
    AssetDagRunQueue,
    AssetEventRow,
    AssetModel,
    AssetWatcherRow,
    DagScheduleAsset,
    TaskOutletAsset,
)
from deferral_cli.common import Record, emit, output_options, sessions

MAX_EVENTS_SHOWN = 100


@command_group()
def assets() -> None:
    """Assets: what tasks' outlets and watchers update, and what DAG schedules wait for."""


@assets.command("list")
@click.option(
    "--events",
    "events",
    type=click.IntRange(0, MAX_EVENTS_SHOWN),
    default=3,
    show_default=True,
    help="How many of each asset's most recent events to show.",
)
@output_options
def assets_list(events: int, output: str) -> None:
    """List assets: uri, the DAGs scheduled on each, the tasks updating it, its watchers (and
    the triggerer running each), how many events wait for a run, and its recent events."""
    settings = settings_or_exit()
    with sessions(settings)() as session:
        records = _records(session, events)
    emit(output, records, empty="no assets")


def _records(session: Session, events: int) -> list[Record]:
    consumers: dict[str, list[str]] = defaultdict(list)
    for dag_id, name in session.execute(
        select(DagScheduleAsset.dag_id, DagScheduleAsset.asset_name).order_by(
            DagScheduleAsset.dag_id
        )
    ):
        consumers[name].append(dag_id)
    producers: dict[str, list[str]] = defaultdict(list)
    for dag_id, task_id, name in session.execute(
        select(TaskOutletAsset.dag_id, TaskOutletAsset.task_id, TaskOutletAsset.asset_name)
    ):
        producers[name].append(f"{dag_id}.{task_id}")
    watchers: dict[str, list[str]] = defaultdict(list)
    for dag_id, name, watcher, holder in session.execute(
        select(
            AssetWatcherRow.dag_id,
            AssetWatcherRow.asset_name,
            AssetWatcherRow.name,
            AssetWatcherRow.triggerer_id,
        ).order_by(AssetWatcherRow.id)
    ):
        watchers[name].append(f"{dag_id}:{watcher}@{holder or '-'}")
    queued = dict(
        session.execute(
            select(AssetDagRunQueue.asset_name, func.count()).group_by(AssetDagRunQueue.asset_name)
        ).all()
    )
    records: list[Record] = []
    for asset in session.scalars(select(AssetModel).order_by(AssetModel.name)):
        recent = session.scalars(
            select(AssetEventRow)
            .where(AssetEventRow.asset_name == asset.name)
            .order_by(AssetEventRow.id.desc())
            .limit(events)
        ).all()
        records.append(
            {
                "name": asset.name,
                "uri": asset.uri,
                "scheduled_dags": consumers.get(asset.name, []),
                "producing_tasks": producers.get(asset.name, []),
                "watchers": watchers.get(asset.name, []),
                "queued_events": int(queued.get(asset.name, 0)),
                "recent_events": [_event(e) for e in recent],
            }
        )
    return records


def _event(event: AssetEventRow) -> str:
    source = (
        f"{event.source_dag_id}.{event.source_run_id}.{event.source_task_id}"
        if event.source_dag_id
        else f"watcher {event.watcher}"
    )
    return f"#{event.id} {event.timestamp.isoformat(timespec='seconds')} {source}"
