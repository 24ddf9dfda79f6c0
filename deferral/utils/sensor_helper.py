"""What TriggerDagRunOperator, ExternalTaskSensor and their triggers read of another DAG's runs
(Airflow's ``airflow.utils.sensor_helper``): reads of ``dag_run`` and ``task_instance``, made
by the waiting task in the worker or by its trigger off the triggerer's event loop, and the pure
rule that turns what they read into "done", "failed", "skipped" or "not yet"."""

from __future__ import annotations

import datetime as dt
from collections import defaultdict
from collections.abc import Collection, Mapping, Sequence
from enum import StrEnum

from sqlalchemy import and_, or_, select
from sqlalchemy.orm import Session

from deferral.exceptions import DagDefinitionError
from deferral.store.seam import DagRun, TaskInstance
from deferral.timezone import make_aware

# The states of one (logical date, task id) key: a task's task instances (one per map index),
# or with no task id ("") the run's own state.
States = Mapping[tuple[dt.datetime, str], Sequence[str]]


class ExternalStatus(StrEnum):
    SUCCESS = "success"
    FAILED = "failed"
    SKIPPED = "skipped"


def date_argument(
    where: str, logical_date: str | dt.datetime | None, execution_date: str | dt.datetime | None
) -> str | dt.datetime | None:
    """A ``logical_date`` argument, or its Airflow 2 name ``execution_date``: a datetime or a
    string (a template, an ISO 8601 date-time), or None."""
    if logical_date is not None and execution_date is not None:
        raise DagDefinitionError(
            f"{where}: give logical_date or execution_date (Airflow 2's name), not both"
        )
    date = logical_date if logical_date is not None else execution_date
    if date is not None and not isinstance(date, str | dt.datetime):
        raise DagDefinitionError(
            f"{where}: logical_date must be a datetime or a string, got {type(date).__name__}"
        )
    return date


def parse_logical_date(value: str | dt.datetime) -> dt.datetime:
    """A rendered logical date: a datetime, or an ISO 8601 string (naive: in the default time
    zone); ValueError naming the value."""
    if isinstance(value, dt.datetime):
        return make_aware(value)
    try:
        return make_aware(dt.datetime.fromisoformat(value))
    except ValueError:
        raise ValueError(f"logical date {value!r} is not an ISO 8601 date-time") from None


def run_of(
    session: Session, dag_id: str, *, run_id: str | None, logical_date: dt.datetime | None
) -> DagRun | None:
    """The run of ``dag_id`` with this run id, else the one at this logical date (a DAG has one
    run per logical date); None if there is neither."""
    clauses = []
    if run_id is not None:
        clauses.append(DagRun.run_id == run_id)
    if logical_date is not None:
        clauses.append(DagRun.logical_date == logical_date)
    if not clauses:
        return None
    rows = session.scalars(select(DagRun).where(DagRun.dag_id == dag_id, or_(*clauses))).all()
    return min(rows, key=lambda row: row.run_id != run_id, default=None)


def read_states(
    session: Session,
    dag_id: str,
    logical_dates: Sequence[dt.datetime],
    task_ids: Collection[str] | None,
) -> dict[tuple[dt.datetime, str], list[str]]:
    """The states of ``task_ids``' task instances in the runs of ``dag_id`` at
    ``logical_dates``, or (``task_ids`` None) the states of those runs themselves."""
    states: dict[tuple[dt.datetime, str], list[str]] = defaultdict(list)
    if not logical_dates:
        return states
    if task_ids is None:
        runs = session.execute(
            select(DagRun.logical_date, DagRun.state).where(
                DagRun.dag_id == dag_id, DagRun.logical_date.in_(logical_dates)
            )
        )
        for logical_date, state in runs:
            states[(logical_date, "")].append(state)
        return states
    rows = session.execute(
        select(DagRun.logical_date, TaskInstance.task_id, TaskInstance.state)
        .join(
            DagRun,
            and_(DagRun.dag_id == TaskInstance.dag_id, DagRun.run_id == TaskInstance.run_id),
        )
        .where(
            TaskInstance.dag_id == dag_id,
            TaskInstance.task_id.in_(list(task_ids)),
            DagRun.logical_date.in_(logical_dates),
        )
    )
    for logical_date, task_id, state in rows:
        states[(logical_date, task_id)].append(state)
    return states


def external_status(
    states: States,
    logical_dates: Sequence[dt.datetime],
    task_ids: Collection[str] | None,
    *,
    allowed: Collection[str],
    failed: Collection[str] = (),
    skipped: Collection[str] = (),
) -> ExternalStatus | None:
    """As Airflow's ExternalTaskSensor decides: FAILED if anything waited for is in a failed
    state, else SKIPPED if anything is in a skipped state, else SUCCESS once every task (every
    map index of it) or run at every logical date is in an allowed state; None: not yet."""
    found = [state for values in states.values() for state in values]
    if any(state in failed for state in found):
        return ExternalStatus.FAILED
    if any(state in skipped for state in found):
        return ExternalStatus.SKIPPED
    keys = [(date, task_id) for date in logical_dates for task_id in (task_ids or [""])]
    if keys and all(states.get(key) and all(s in allowed for s in states[key]) for key in keys):
        return ExternalStatus.SUCCESS
    return None
