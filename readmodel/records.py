"""What the CLI and the web UI both show of the database: records (plain mappings with typed
values) of runs and task instances, and how such values become JSON."""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from deferral.store.tables import DagRun, TaskInstance

Record = Mapping[str, Any]


def json_value(value: Any) -> Any:
    if isinstance(value, dt.datetime | dt.date):
        return value.isoformat()
    if isinstance(value, dt.timedelta):
        return value.total_seconds()
    if isinstance(value, set | frozenset | tuple):
        return list(value)
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


def when(value: dt.datetime | None) -> str:
    return "-" if value is None else value.isoformat(timespec="seconds")


def db_now(session: Session) -> dt.datetime:
    """The database's clock, the one that wrote the rows read: no skew with this host."""
    now: dt.datetime = session.scalars(select(func.now())).one()
    return now


def seconds_between(start: dt.datetime, end: dt.datetime) -> float:
    return round(max(0.0, (end - start).total_seconds()), 3)


def run_record(run: DagRun) -> Record:
    return {
        "dag_id": run.dag_id,
        "run_id": run.run_id,
        "run_type": run.run_type,
        "state": run.state,
        "logical_date": run.logical_date,
        "data_interval_start": run.data_interval_start,
        "data_interval_end": run.data_interval_end,
        "start_date": run.start_date,
        "end_date": run.end_date,
    }


def find_run(session: Session, dag_id: str, run_id: str) -> DagRun | None:
    """The run ``run_id`` of DAG ``dag_id``, or None if there is none."""
    return session.scalars(
        select(DagRun).where(DagRun.dag_id == dag_id, DagRun.run_id == run_id)
    ).one_or_none()


def task_instances(session: Session, dag_id: str, run_id: str, task_id: str) -> list[TaskInstance]:
    """The task instances of ``task_id`` in one run (a mapped task's map indexes in order)."""
    return list(
        session.scalars(
            select(TaskInstance)
            .where(
                TaskInstance.dag_id == dag_id,
                TaskInstance.run_id == run_id,
                TaskInstance.task_id == task_id,
            )
            .order_by(TaskInstance.map_index)
        )
    )
