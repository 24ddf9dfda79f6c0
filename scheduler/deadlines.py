"""Deadline alerts: record the runs that had not finished by a DeadlineAlert's deadline, once.

Each miss is an ``INSERT ... ON CONFLICT DO NOTHING`` into ``deadline_miss`` (unique per run and
alert): of the scheduler replicas that see it, exactly one inserts the row, and only that one
counts it and runs the callback, after its transaction committed (off the loop, as the DAG
callbacks). The callback's outcome is written back to the row (done, or failed: <one line>).
"""

from __future__ import annotations

import datetime as dt
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import select, update
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.orm import Session, sessionmaker

from deferral.dag import DAG
from deferral.deadline import DeadlineAlert, run_callback
from deferral.states import DagRunState
from deferral.store.tables import DagRun, DeadlineMiss

log = logging.getLogger("deferral.scheduler.deadlines")

# Unfinished runs looked at per check (the oldest first); the rest wait for the next check.
MAX_RUNS_PER_CHECK = 5_000
# Finished runs looked at again for this long: one that ended past its deadline between two
# checks (a second apart) is recorded too.
FINISHED_LOOKBACK = dt.timedelta(seconds=30)
# What is kept of a callback's error in deadline_miss.callback_state.
MAX_ERROR_CHARS = 500


@dataclass(frozen=True)
class Missed:
    """A miss this replica recorded: its callback is this replica's to run."""

    miss_id: int
    alert: DeadlineAlert
    context: Mapping[str, Any]


def record_misses(session: Session, dags: Mapping[str, DAG], now: dt.datetime) -> list[Missed]:
    """Insert a deadline_miss row for each run of ``dags`` unfinished past one of its DAG's
    deadlines (or that finished after it) and not yet recorded; returns those this call
    inserted."""
    alerts = {dag_id: found for dag_id, dag in dags.items() if (found := dag.deadline_alerts())}
    if not alerts:
        return []
    runs = session.execute(
        select(
            DagRun.id,
            DagRun.dag_id,
            DagRun.run_id,
            DagRun.created_at,
            DagRun.logical_date,
            DagRun.end_date,
        )
        .where(
            DagRun.dag_id.in_(alerts),
            # Unfinished, or finished since the last checks: a run that ended late between two
            # checks missed its deadline too.
            DagRun.state.in_([DagRunState.QUEUED, DagRunState.RUNNING])
            | (DagRun.end_date > now - FINISHED_LOOKBACK),
        )
        .order_by(DagRun.id)
        .limit(MAX_RUNS_PER_CHECK)
    ).all()
    missed: list[Missed] = []
    for run in runs:
        for index, alert in enumerate(alerts[run.dag_id]):
            deadline = alert.deadline(run.created_at, run.logical_date)
            if deadline > (now if run.end_date is None else min(run.end_date, now)):
                continue
            miss_id = session.scalar(
                pg_insert(DeadlineMiss)
                .values(
                    dag_run_id=run.id,
                    dag_id=run.dag_id,
                    run_id=run.run_id,
                    alert_index=index,
                    deadline=deadline,
                )
                .on_conflict_do_nothing()
                .returning(DeadlineMiss.id)
            )
            if miss_id is None:
                continue  # recorded before, here or by another replica
            context = {
                "dag_id": run.dag_id,
                "run_id": run.run_id,
                "logical_date": run.logical_date,
                "deadline": deadline,
            }
            missed.append(Missed(miss_id, alert, context))
    return missed


def call_back(sessions: sessionmaker[Session], missed: Sequence[Missed]) -> None:
    """Run the callbacks of committed misses (in a callback thread), recording each outcome."""
    for miss in missed:
        try:
            run_callback(miss.alert, miss.context)
            outcome = "done"
        except Exception as exc:
            log.exception("deadline callback of %s failed", miss.context)
            outcome = f"failed: {type(exc).__name__}: {exc}".splitlines()[0][:MAX_ERROR_CHARS]
        with sessions.begin() as session:
            session.execute(
                update(DeadlineMiss)
                .where(DeadlineMiss.id == miss.miss_id)
                .values(callback_state=outcome)
            )
