"""The runs asset events make: each DAG scheduled on assets consumes the events queued for it
(``deferral.store.transitions.asset_events`` records them) in runs of its own."""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping, Sequence

from sqlalchemy import delete, func, insert, select
from sqlalchemy.orm import Session

from deferral.assets import BaseAsset, plan_runs
from deferral.states import DagRunState, DagRunType
from deferral.store.tables import AssetDagRunQueue, Dag, DagRun, DagRunAssetEvent
from deferral.store.transitions.runs import NewDagRun, create_dag_runs_once


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


def create_asset_runs(
    session: Session, conditions: Mapping[str, BaseAsset], now: dt.datetime, limit: int
) -> list[tuple[str, str]]:
    """Create a run (queued) of each unpaused active DAG scheduled on assets per set of queued
    events that satisfies its condition (no more than ``max_active_runs`` allows beside its
    queued and running ones, at most ``limit`` per DAG), consuming those events. The DAG rows are
    locked (``SKIP LOCKED``) so replicas never consume an event twice. Returns (dag id, run id)
    of the runs created."""
    if not conditions:
        return []
    rows = session.execute(
        select(Dag.dag_id, Dag.max_active_runs)
        .where(
            Dag.dag_id.in_(sorted(conditions)),
            Dag.is_paused.is_(False),
            Dag.is_active.is_(True),
            Dag.missing_since.is_(None),
            Dag.dag_id.in_(select(AssetDagRunQueue.target_dag_id)),
        )
        .order_by(Dag.dag_id)
        .with_for_update(skip_locked=True)
    ).all()
    created: list[tuple[str, str]] = []
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
        if room <= 0:
            continue
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
        created += _create(session, dag_id, plan_runs(conditions[dag_id], queued, room), now)
    return created


def _create(
    session: Session, dag_id: str, plans: Sequence[list[int]], now: dt.datetime
) -> list[tuple[str, str]]:
    """Create one run per plan (its events' ids) in a few statements: the runs, their links to
    the events, the queue rows consumed. A run whose logical date is taken is not made, and its
    events stay queued for the next call."""
    if not plans:
        return []
    first = _logical_date(session, dag_id, now)
    runs = [
        NewDagRun(dag_id, DagRunType.ASSET_TRIGGERED, moment, moment, moment)
        for moment in (first + dt.timedelta(microseconds=n) for n in range(len(plans)))
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
    done = [(run, events) for run, events in zip(runs, plans, strict=True) if run.run_id in made]
    session.execute(
        insert(DagRunAssetEvent),
        [
            {"dag_run_id": ids[run.run_id], "asset_event_id": i}
            for run, events in done
            for i in events
        ],
    )
    session.execute(
        delete(AssetDagRunQueue).where(
            AssetDagRunQueue.target_dag_id == dag_id,
            AssetDagRunQueue.asset_event_id.in_([i for _, events in done for i in events]),
        )
    )
    return [(dag_id, run.run_id) for run, _ in done]
