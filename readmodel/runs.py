"""DAG runs as ``deferral runs list`` and ``runs show`` give them: pages of runs, newest logical
date first, and a run's task instances in the order they were created."""

from __future__ import annotations

import datetime as dt

from sqlalchemy import select, tuple_
from sqlalchemy.orm import Session

from deferral.store.tables import DagRun, TaskInstance
from readmodel.pages import Page, decode, page_of
from readmodel.records import run_record


def run_list(
    session: Session,
    *,
    limit: int,
    after: str | None = None,
    dag_id: str | None = None,
    state: str | None = None,
) -> Page:
    """A page of runs (of ``dag_id``, in ``state``, if given), newest logical date first, from
    just after cursor ``after``."""
    query = select(DagRun).order_by(DagRun.logical_date.desc(), DagRun.id.desc()).limit(limit + 1)
    if after is not None:
        last_date, last_id = decode(after, dt.datetime, int)
        query = query.where(tuple_(DagRun.logical_date, DagRun.id) < (last_date, last_id))
    if dag_id is not None:
        query = query.where(DagRun.dag_id == dag_id)
    if state is not None:
        query = query.where(DagRun.state == state)
    return page_of(
        session.scalars(query).all(), limit, run_record, lambda run: (run.logical_date, run.id)
    )


def run_task_instances(session: Session, dag_id: str, run_id: str) -> list[TaskInstance]:
    """A run's task instances, each task in the order it was created, a mapped task's map
    indexes together and in order (map index 0 was its placeholder)."""
    tis = session.scalars(
        select(TaskInstance)
        .where(TaskInstance.dag_id == dag_id, TaskInstance.run_id == run_id)
        .order_by(TaskInstance.id)
    ).all()
    order = {ti.task_id: ti.id for ti in reversed(tis)}
    return sorted(tis, key=lambda ti: (order[ti.task_id], ti.map_index))
