"""Deadline misses against real PostgreSQL: recorded once per run and alert however often (and
by however many schedulers) they are looked for; a run that finished past its deadline between
two checks is recorded, one that finished in time is not; DAGs without alerts cost no query."""

from __future__ import annotations

import datetime as dt

from sqlalchemy import select, update
from sqlalchemy.orm import Session, sessionmaker

from deferral import DAG
from deferral.deadline import DeadlineAlert, DeadlineReference
from deferral.store import transitions
from deferral.store.tables import DagRun, DeadlineMiss
from scheduler import deadlines

NOW = dt.datetime.now(dt.UTC)


def _run(sessions: sessionmaker[Session], run_id: str, **values: object) -> None:
    logical_date = NOW - dt.timedelta(hours=sum(map(ord, run_id)))  # one per run
    with sessions.begin() as session:
        transitions.create_dag_run(session, "late", run_id, logical_date, {})
        if values:
            session.execute(update(DagRun).where(DagRun.run_id == run_id).values(**values))


def test_each_miss_is_recorded_once(sessions: sessionmaker[Session]) -> None:
    minute = dt.timedelta(minutes=1)
    alert = DeadlineAlert(DeadlineReference.FIXED_DATETIME(NOW - 2 * minute), minute)
    dags = {"late": DAG("late", deadline=[alert, DeadlineAlert(alert.reference, 3 * minute)])}
    _run(sessions, "unfinished")
    _run(sessions, "ended_late", state="success", end_date=NOW)
    _run(sessions, "ended_in_time", state="success", end_date=NOW - 1.5 * minute)
    with sessions.begin() as session:
        first = deadlines.record_misses(session, dags, NOW)
    with sessions.begin() as session:
        again = deadlines.record_misses(session, dags, NOW + minute)
    assert sorted((m.context["run_id"], m.alert.interval) for m in first) == [
        ("ended_late", minute),
        ("unfinished", minute),
    ]
    # The second alert's deadline (NOW + 1 min) has come: missed by the unfinished run only (the
    # other ended before it); the first alert's misses are not recorded twice.
    assert [m.context["run_id"] for m in again] == ["unfinished"]
    with sessions() as session:
        assert len(session.scalars(select(DeadlineMiss)).all()) == 3
    with sessions.begin() as session:
        assert deadlines.record_misses(session, {"other": DAG("other")}, NOW) == []
