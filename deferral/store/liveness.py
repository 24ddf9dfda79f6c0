"""Whether a scheduler, worker or triggerer process is alive, and their rows in Postgres.

Each process upserts its row (``scheduler`` / ``worker`` / ``triggerer``) every heartbeat. One
rule says whether it is alive, for the reconciler, ``doctor``, ``health``, ``tasks explain`` and
the listings alike: state running and a heartbeat at most 2.1 x heartbeat old (the same margin as
the stream leases: one late beat plus clock and network jitter), measured with the database's
clock.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

from sqlalchemy import ColumnElement, and_, func
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.orm import Session

from deferral.store.tables import Scheduler, Triggerer, Worker

STALE_AFTER_HEARTBEATS = 2.1
RUNNING = "running"
STOPPED = "stopped"

# The processes that heartbeat a row of their own.
Process = type[Scheduler] | type[Worker] | type[Triggerer]


def stale_after_sec(heartbeat_sec: float) -> float:
    return STALE_AFTER_HEARTBEATS * heartbeat_sec


def heartbeat_age_sec(latest_heartbeat: dt.datetime, now: dt.datetime) -> float:
    """Seconds since the heartbeat (never negative: ``now`` is the database's clock too)."""
    return max(0.0, (now - latest_heartbeat).total_seconds())


def is_alive(
    state: str, latest_heartbeat: dt.datetime, now: dt.datetime, heartbeat_sec: float
) -> bool:
    age = (now - latest_heartbeat).total_seconds()
    return state == RUNNING and age <= stale_after_sec(heartbeat_sec)


def health(
    state: str, latest_heartbeat: dt.datetime, now: dt.datetime, heartbeat_sec: float
) -> str:
    """What the listings say of a process: alive, stopped (it said so on its way out), or stale
    (it stopped heartbeating without saying so: killed, hung or cut off)."""
    if is_alive(state, latest_heartbeat, now, heartbeat_sec):
        return "alive"
    return "stopped" if state == STOPPED else "stale"


def alive_clause(model: Process, heartbeat_sec: float) -> ColumnElement[bool]:
    """:func:`is_alive` as SQL, for queries that join on it."""
    margin = dt.timedelta(seconds=stale_after_sec(heartbeat_sec))
    return and_(model.state == RUNNING, model.latest_heartbeat >= func.now() - margin)


def heartbeat(session: Session, model: Process, values: dict[str, Any]) -> None:
    """Insert or refresh a process's row, stamping its heartbeat with the database's clock."""
    statement = insert(model).values(**values)
    session.execute(
        statement.on_conflict_do_update(
            index_elements=[model.name], set_={**values, "latest_heartbeat": func.now()}
        )
    )
