"""Reading asset events: a run's ``triggering_asset_events`` and a task's ``inlet_events`` (for
its context) and the recent events of each asset (for the CLI and the web UI)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from deferral.assets import Asset, AssetAlias, AssetEvent, TriggeringAssetEvents
from deferral.store.metastore import metastore
from deferral.store.tables import (
    AssetAliasEvent,
    AssetEventRow,
    AssetModel,
    DagRun,
    DagRunAssetEvent,
)

# Events one run's context carries per asset at most (the rest are counted, not loaded).
MAX_EVENTS_PER_ASSET = 1000


def _event(row: AssetEventRow, asset: Asset) -> AssetEvent:
    return AssetEvent(
        id=row.id,
        asset=asset,
        extra=dict(row.extra or {}),
        timestamp=row.timestamp,
        source_dag_id=row.source_dag_id,
        source_run_id=row.source_run_id,
        source_task_id=row.source_task_id,
        source_map_index=row.source_map_index,
        watcher=row.watcher,
    )


def triggering_events(session: Session, dag_id: str, run_id: str) -> TriggeringAssetEvents:
    """The asset events the run consumed, by asset name, oldest first."""
    rows = session.execute(
        select(AssetEventRow, AssetModel.uri)
        .join(DagRunAssetEvent, DagRunAssetEvent.asset_event_id == AssetEventRow.id)
        .join(DagRun, DagRun.id == DagRunAssetEvent.dag_run_id)
        .outerjoin(AssetModel, AssetModel.name == AssetEventRow.asset_name)
        .where(DagRun.dag_id == dag_id, DagRun.run_id == run_id)
        .order_by(AssetEventRow.id)
    ).all()
    events: dict[str, list[AssetEvent]] = {}
    for row, uri in rows:
        got = events.setdefault(row.asset_name, [])
        if len(got) < MAX_EVENTS_PER_ASSET:
            got.append(_event(row, Asset(name=row.asset_name, uri=uri or row.asset_name)))
    return TriggeringAssetEvents(events)


def events_of(session: Session, asset: Asset) -> list[AssetEvent]:
    """The latest events of ``asset`` (at most MAX_EVENTS_PER_ASSET), oldest first."""
    rows = session.scalars(
        select(AssetEventRow)
        .where(AssetEventRow.asset_name == asset.name)
        .order_by(AssetEventRow.id.desc())
        .limit(MAX_EVENTS_PER_ASSET)
    ).all()
    return [_event(row, asset) for row in reversed(rows)]


def events_of_alias(session: Session, alias: AssetAlias) -> list[AssetEvent]:
    """The latest events added through ``alias`` (at most MAX_EVENTS_PER_ASSET), oldest
    first."""
    rows = session.execute(
        select(AssetEventRow, AssetModel.uri)
        .join(AssetAliasEvent, AssetAliasEvent.asset_event_id == AssetEventRow.id)
        .outerjoin(AssetModel, AssetModel.name == AssetEventRow.asset_name)
        .where(AssetAliasEvent.alias_name == alias.name)
        .order_by(AssetEventRow.id.desc())
        .limit(MAX_EVENTS_PER_ASSET)
    ).all()
    return [
        _event(row, Asset(name=row.asset_name, uri=uri or row.asset_name))
        for row, uri in reversed(rows)
    ]


class LazyInletEvents(Mapping[Any, list[AssetEvent]]):
    """``context["inlet_events"]`` (Airflow 3's): the events of each of the task's ``inlets``
    (by Asset or name; ``for_asset(name=, uri=)``), oldest first, each read from PostgreSQL on
    first use only; those of an alias among them (by the AssetAlias) are the events added
    through it."""

    def __init__(self, inlets: Iterable[Asset | AssetAlias]) -> None:
        inlets = list(inlets)
        self._inlets = {a.name: a for a in inlets if isinstance(a, Asset)}
        self._aliases = {a.name: a for a in inlets if isinstance(a, AssetAlias)}
        self._loaded: dict[str, list[AssetEvent]] = {}

    def __getitem__(self, key: object) -> list[AssetEvent]:
        if isinstance(key, AssetAlias):
            if key.name not in self._aliases:
                known = ", ".join(sorted(self._aliases)) or "none"
                raise KeyError(f"{key!r} is not an inlet of this task (aliases: {known})")
            if key.key not in self._loaded:
                with metastore().sessions() as session:
                    self._loaded[key.key] = events_of_alias(session, key)
            return self._loaded[key.key]
        name = key.name if isinstance(key, Asset) else key
        if not isinstance(name, str) or name not in self._inlets:
            known = ", ".join(sorted(self._inlets)) or "none"
            raise KeyError(f"{name!r} is not an inlet of this task (inlets: {known})")
        if name not in self._loaded:
            with metastore().sessions() as session:
                self._loaded[name] = events_of(session, self._inlets[name])
        return self._loaded[name]

    def for_asset(self, *, name: str | None = None, uri: str | None = None) -> list[AssetEvent]:
        for asset in self._inlets.values():
            if (name is None or asset.name == name) and (uri is None or asset.uri == uri):
                return self[asset]
        raise KeyError(f"no inlet of this task has name {name!r} and uri {uri!r}")

    def __iter__(self) -> Iterator[str]:
        return iter(self._inlets)

    def __len__(self) -> int:
        return len(self._inlets)


class LazyTriggeringEvents(Mapping[Any, list[AssetEvent]]):
    """``context["triggering_asset_events"]``, read from PostgreSQL on first use only."""

    def __init__(self, dag_id: str, run_id: str) -> None:
        self.dag_id = dag_id
        self.run_id = run_id
        self._loaded: TriggeringAssetEvents | None = None

    def _events(self) -> TriggeringAssetEvents:
        if self._loaded is None:
            with metastore().sessions() as session:
                self._loaded = triggering_events(session, self.dag_id, self.run_id)
        return self._loaded

    def __getitem__(self, key: object) -> list[AssetEvent]:
        return self._events()[key]

    def __contains__(self, key: object) -> bool:
        return key in self._events()

    def __iter__(self) -> Any:
        return iter(self._events())

    def __len__(self) -> int:
        return len(self._events())
