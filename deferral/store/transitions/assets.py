"""The runs asset events make: each DAG scheduled on assets consumes the events queued for it
(``deferral.store.transitions.asset_events`` records them) in runs of its own; a DAG scheduled
on assets' partitions (``PartitionedAssetTimetable``) in one run per mapped partition key."""

from __future__ import annotations

import datetime as dt
import logging
from collections.abc import Mapping, Sequence

from sqlalchemy import Row, delete, func, insert, select
from sqlalchemy.orm import Session

from deferral.assets import BaseAsset, plan_runs
from deferral.partitions import RollupMapper
from deferral.states import DagRunState, DagRunType
from deferral.store.tables import AssetDagRunQueue, AssetEventRow, Dag, DagRun, DagRunAssetEvent
from deferral.store.transitions.runs import NewDagRun, create_dag_runs_once
from deferral.timetables.partitions import PartitionedAssetTimetable

log = logging.getLogger("deferral.scheduler")

# Queued events of one DAG scheduled on partitions that one pass reads (oldest first): a key
# whose events are further back waits for the older ones to make their runs.
PARTITION_EVENTS_PER_PASS = 1000


def _logical_date(session: Session, dag_id: str, now: dt.datetime) -> dt.datetime:
    """A logical date for the next asset-triggered run of ``dag_id``: after its latest run's
    (dag_run has one run per logical date), called under the DAG row's lock."""
    latest = session.scalar(
        select(DagRun.logical_date)
        .where(DagRun.dag_id == dag_id)
        .order_by(DagRun.logical_date.desc())
        .limit(1)
    )
    return now if latest is None or latest < now else latest + dt.timedelta(microseconds=1)


def _with_room(session: Session, dag_ids: Sequence[str], limit: int) -> list[tuple[str, int]]:
    """The unpaused active DAGs of ``dag_ids`` with queued events, locked (``SKIP LOCKED``, so
    replicas never consume an event twice), each with the runs it may get now (no more than
    ``max_active_runs`` allows beside its queued and running ones, at most ``limit``)."""
    rows = session.execute(
        select(Dag.dag_id, Dag.max_active_runs)
        .where(
            Dag.dag_id.in_(sorted(dag_ids)),
            Dag.is_paused.is_(False),
            Dag.is_active.is_(True),
            Dag.missing_since.is_(None),
            Dag.dag_id.in_(select(AssetDagRunQueue.target_dag_id)),
        )
        .order_by(Dag.dag_id)
        .with_for_update(skip_locked=True)
    ).all()
    rooms: list[tuple[str, int]] = []
    for dag_id, max_active_runs in rows:
        active = session.scalar(
            select(func.count())
            .select_from(DagRun)
            .where(
                DagRun.dag_id == dag_id,
                DagRun.state.in_((DagRunState.QUEUED, DagRunState.RUNNING)),
            )
        )
        room = min(limit, max_active_runs - int(active or 0))
        if room > 0:
            rooms.append((dag_id, room))
    return rooms


def create_asset_runs(
    session: Session, conditions: Mapping[str, BaseAsset], now: dt.datetime, limit: int
) -> list[tuple[str, str]]:
    """Create a run (queued) of each unpaused active DAG scheduled on assets per set of queued
    events that satisfies its condition (at most ``limit`` per DAG, within its
    ``max_active_runs``), consuming those events. Returns (dag id, run id) of the runs created."""
    if not conditions:
        return []
    created: list[tuple[str, str]] = []
    for dag_id, room in _with_room(session, list(conditions), limit):
        # A run consumes at most one event per asset: the oldest ``room`` of each asset do.
        ranked = (
            select(
                AssetDagRunQueue.asset_name,
                AssetDagRunQueue.asset_event_id,
                func.row_number()
                .over(
                    partition_by=AssetDagRunQueue.asset_name,
                    order_by=AssetDagRunQueue.asset_event_id,
                )
                .label("rank"),
            )
            .where(AssetDagRunQueue.target_dag_id == dag_id)
            .subquery()
        )
        queued: dict[str, list[int]] = {}
        for name, event_id in session.execute(
            select(ranked.c.asset_name, ranked.c.asset_event_id)
            .where(ranked.c.rank <= room)
            .order_by(ranked.c.asset_event_id)
        ):
            queued.setdefault(name, []).append(event_id)
        plans = [(events, None) for events in plan_runs(conditions[dag_id], queued, room)]
        done = _create(session, dag_id, plans, now)
        _consume(session, dag_id, [i for _, events in done for i in events])
        created += [(dag_id, run.run_id) for run, _ in done]
    return created


def mapped_keys(timetable: PartitionedAssetTimetable, asset_name: str, key: str) -> list[str]:
    """The downstream keys an event of ``asset_name`` with partition ``key`` belongs to, by the
    asset's mapper (a ValueError: the key is not for this DAG)."""
    mapped = timetable.mapper_of(asset_name).to_downstream(key)
    return [mapped] if isinstance(mapped, str) else list(mapped)


def create_partition_runs(
    session: Session,
    timetables: Mapping[str, PartitionedAssetTimetable],
    now: dt.datetime,
    limit: int,
) -> list[tuple[str, str]]:
    """Create one run (queued, ``partition_key`` set) per downstream partition key of each
    unpaused active DAG scheduled on assets' partitions whose queued events mapped to that key
    satisfy its condition (``a & b``: an event of each for the same mapped key; a rollup's
    asset counts once its window's members are there, by its wait policy), at most
    ``limit`` per DAG within its ``max_active_runs``; the run consumes every queued event of its
    key, so later events of the key make another run (as Airflow's, once the key's run was
    made). An event with no key, or one its mapper refuses, is consumed with no run (a warning
    naming the key). Reads at most ``PARTITION_EVENTS_PER_PASS`` queued events per DAG."""
    if not timetables:
        return []
    created: list[tuple[str, str]] = []
    for dag_id, room in _with_room(session, list(timetables), limit):
        rows = session.execute(
            select(
                AssetDagRunQueue.asset_name,
                AssetDagRunQueue.asset_event_id,
                AssetEventRow.partition_key,
            )
            .join(AssetEventRow, AssetEventRow.id == AssetDagRunQueue.asset_event_id)
            .where(AssetDagRunQueue.target_dag_id == dag_id)
            .order_by(AssetDagRunQueue.asset_event_id)
            .limit(PARTITION_EVENTS_PER_PASS)
        ).all()
        keys_of, by_key, ready = _map_events(dag_id, timetables[dag_id], rows)
        plans = [
            (sorted(i for ids in events.values() for i in ids), key)
            for key, events in by_key.items()
            if key in ready
        ][:room]
        done = _create(session, dag_id, plans, now)
        # An event goes with the first run that consumes it (a fan-out's keys made in the same
        # pass share it), or at once if it maps to no key.
        consumed = [i for _, events in done for i in events]
        _consume(session, dag_id, consumed + [i for i, keys in keys_of.items() if not keys])
        created += [(dag_id, run.run_id) for run, _ in done]
    return created


def _map_events(
    dag_id: str,
    timetable: PartitionedAssetTimetable,
    rows: Sequence[Row[str, int, str | None]],
) -> tuple[dict[int, list[str]], dict[str, dict[str, list[int]]], set[str]]:
    """The downstream keys of each queued event (none: it makes no run); the events of each
    downstream key by asset name, keys in the order of their oldest event; and the downstream
    keys whose assets' events are all there (a rollup's members, by its wait policy)."""
    keys_of: dict[int, list[str]] = {}
    by_key: dict[str, dict[str, list[int]]] = {}
    members: dict[tuple[str, str], set[str]] = {}
    for asset_name, event_id, key in rows:
        keys_of[event_id] = []
        if key is None:
            log.info("DAG %s: asset %r event %d has no partition key", dag_id, asset_name, event_id)
            continue
        try:
            keys_of[event_id] = mapped_keys(timetable, asset_name, key)
        except ValueError as exc:
            log.warning(
                "DAG %s: asset %r event %d makes no run: %s", dag_id, asset_name, event_id, exc
            )
            continue
        for downstream in keys_of[event_id]:
            by_key.setdefault(downstream, {}).setdefault(asset_name, []).append(event_id)
            members.setdefault((downstream, asset_name), set()).add(key)
    ready: set[str] = set()
    for downstream, events in by_key.items():
        arrived = set()
        for asset_name in events:
            mapper = timetable.mapper_of(asset_name)
            try:
                if not isinstance(mapper, RollupMapper) or mapper.complete(
                    downstream, members[(downstream, asset_name)]
                ):
                    arrived.add(asset_name)
            except ValueError as exc:
                log.warning("DAG %s: asset %r key %r: %s", dag_id, asset_name, downstream, exc)
        if timetable.condition.evaluate(arrived):
            ready.add(downstream)
    return keys_of, by_key, ready


def _create(
    session: Session, dag_id: str, plans: Sequence[tuple[list[int], str | None]], now: dt.datetime
) -> list[tuple[NewDagRun, list[int]]]:
    """Create one run per plan (its events' ids and partition key) in a few statements: the
    runs and their links to the events. A run whose logical date (or partition key) is taken is
    not made. Returns the runs made with their events."""
    if not plans:
        return []
    first = _logical_date(session, dag_id, now)
    runs = [
        NewDagRun(dag_id, DagRunType.ASSET_TRIGGERED, moment, moment, moment, partition_key=key)
        for moment, (_, key) in (
            (first + dt.timedelta(microseconds=n), plan) for n, plan in enumerate(plans)
        )
    ]
    made = set(create_dag_runs_once(session, runs))
    if not made:
        return []
    ids = dict(
        session.execute(
            select(DagRun.run_id, DagRun.id).where(
                DagRun.dag_id == dag_id, DagRun.run_id.in_(sorted(made))
            )
        ).all()
    )
    done = [
        (run, events) for run, (events, _) in zip(runs, plans, strict=True) if run.run_id in made
    ]
    session.execute(
        insert(DagRunAssetEvent),
        [
            {"dag_run_id": ids[run.run_id], "asset_event_id": i}
            for run, events in done
            for i in events
        ],
    )
    return done


def _consume(session: Session, dag_id: str, event_ids: Sequence[int]) -> None:
    """The queue rows of ``dag_id``'s events ``event_ids`` go (their runs are made)."""
    if event_ids:
        session.execute(
            delete(AssetDagRunQueue).where(
                AssetDagRunQueue.target_dag_id == dag_id,
                AssetDagRunQueue.asset_event_id.in_(sorted(set(event_ids))),
            )
        )
