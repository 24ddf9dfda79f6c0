"""Triggerer and worker processes as ``deferral triggerers list``, ``workers list`` and the web
UI's Triggerers page show them: who each is, its load, its heartbeat and whether it is alive."""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable
from typing import Any, TypeVar

from sqlalchemy import select
from sqlalchemy.orm import Session

from deferral.runtime.config import Settings
from deferral.store import liveness
from deferral.store.tables import Triggerer, Worker
from readmodel.records import Record, db_now

Process = TypeVar("Process", Triggerer, Worker)


def processes(session: Session, settings: Settings) -> dict[str, list[Record]]:
    """Triggerers (capacity, load, heartbeat age, alive or stale) and workers, as the CLI's
    listings give them."""
    return {
        "triggerers": process_records(session, Triggerer, triggerer_own, settings.heartbeat_sec),
        "workers": process_records(session, Worker, worker_own, settings.heartbeat_sec),
    }


def process_records(
    session: Session, model: type[Process], own: Callable[[Process], Record], heartbeat_sec: float
) -> list[Record]:
    """A record per process of a kind, by name: who it is, what it has of its ``own``, its
    heartbeat and whether it is alive."""
    now = db_now(session)
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
