"""What the CLI and the web UI both show of the database: records (plain mappings with typed
values) of runs, task instances and processes, and how such values become JSON."""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from deferral.store import liveness
from deferral.store.tables import DagRun, TaskInstance, Triggerer, Worker

Record = Mapping[str, Any]
Process = TypeVar("Process", Triggerer, Worker)


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


def process_records(
    session: Session, model: type[Process], own: Callable[[Process], Record], heartbeat_sec: float
) -> list[Record]:
    """A record per process of a kind, by name: who it is, what it has of its ``own``, its
    heartbeat and whether it is alive."""
    # The database's clock, the one that wrote the heartbeats: no skew with this host.
    now = session.scalars(select(func.now())).one()
    return [
        {**_identity(process), **own(process), **_liveness(process, now, heartbeat_sec)}
        for process in session.scalars(select(model).order_by(model.name))
    ]


def triggerer_own(triggerer: Triggerer) -> Record:
    return {"load": triggerer.load, "capacity": triggerer.capacity}


def worker_own(worker: Worker) -> Record:
    return {"queue": worker.queue, "load": worker.load, "concurrency": worker.concurrency}


def _identity(process: Triggerer | Worker) -> dict[str, Any]:
    return {
        "name": process.name,
        "hostname": process.hostname,
        "pid": process.pid,
        "state": process.state,
    }


def _liveness(process: Triggerer | Worker, now: dt.datetime, heartbeat_sec: float) -> Record:
    """The heartbeat, its age, and whether the process is alive by
    :mod:`deferral.store.liveness`."""
    return {
        "latest_heartbeat": process.latest_heartbeat,
        "heartbeat_age_sec": round(liveness.heartbeat_age_sec(process.latest_heartbeat, now), 1),
        "health": liveness.health(process.state, process.latest_heartbeat, now, heartbeat_sec),
    }
