"""Triggers that wait on another DAG's runs (Airflow's ``airflow.triggers.external_task``):
``DagStateTrigger`` for TriggerDagRunOperator(wait_for_completion=True, deferrable=True),
``WorkflowTrigger`` for a deferrable ExternalTaskSensor. Each polls PostgreSQL (the database of
``DEFERRAL_DATABASE_URL``, as task code reads it) in a worker thread, never on the event loop,
every ``poll_interval`` seconds; the event carries states, never rows."""

from __future__ import annotations

import datetime as dt
from collections.abc import AsyncIterator, Sequence
from typing import Any

import anyio

from deferral.store.seam import metastore
from deferral.triggers.base import BaseTrigger, TriggerEvent, classpath_of
from deferral.utils.sensor_helper import ExternalStatus, external_status, read_states


def _dates(name: str, values: Sequence[dt.datetime]) -> list[dt.datetime]:
    dates = list(values)
    if not dates or not all(
        isinstance(d, dt.datetime) and d.utcoffset() is not None for d in dates
    ):
        raise ValueError(f"{name} must be a non-empty list of tz-aware datetimes")
    return dates


def _interval(value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
        raise ValueError(f"poll_interval must be a number of seconds > 0, got {value!r}")
    return float(value)


class _DatabasePollTrigger(BaseTrigger):
    """Fires with what ``check()`` (blocking, run in a thread) returns once it is not None."""

    poll_interval: float

    def check(self) -> Any:
        raise NotImplementedError

    async def run(self) -> AsyncIterator[TriggerEvent]:
        while (payload := await anyio.to_thread.run_sync(self.check)) is None:
            await anyio.sleep(self.poll_interval)
        yield TriggerEvent(payload)


class DagStateTrigger(_DatabasePollTrigger):
    """Fires when the runs of ``dag_id`` at ``logical_dates`` (``execution_dates``: Airflow 2's
    name) are all in one of ``states``; the payload is ``{"dag_id", "logical_dates",
    "states"}``, each run's state in the order of ``logical_dates``."""

    def __init__(
        self,
        dag_id: str,
        states: Sequence[str],
        logical_dates: Sequence[dt.datetime] | None = None,
        poll_interval: float = 5.0,
        *,
        execution_dates: Sequence[dt.datetime] | None = None,
    ) -> None:
        super().__init__()
        if (logical_dates is None) == (execution_dates is None):
            raise TypeError("give logical_dates or its alias execution_dates, not both")
        self.dag_id = dag_id
        self.states = [str(state) for state in states]
        self.logical_dates = _dates("logical_dates", logical_dates or execution_dates or [])
        self.poll_interval = _interval(poll_interval)

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return classpath_of(DagStateTrigger), {
            "dag_id": self.dag_id,
            "states": self.states,
            "logical_dates": self.logical_dates,
            "poll_interval": self.poll_interval,
        }

    def check(self) -> dict[str, Any] | None:
        with metastore().sessions() as session:
            found = read_states(session, self.dag_id, self.logical_dates, None)
        states = [(found.get((date, "")) or [""])[0] for date in self.logical_dates]
        if not all(state in self.states for state in states):
            return None
        return {"dag_id": self.dag_id, "logical_dates": self.logical_dates, "states": states}


class WorkflowTrigger(_DatabasePollTrigger):
    """Fires when the tasks ``external_task_ids`` of ``external_dag_id`` (or, without them, its
    runs) at ``logical_dates`` are done as ExternalTaskSensor decides
    (``sensor_helper.external_status``); the payload is ``{"status": "success" | "failed" |
    "skipped"}``."""

    def __init__(
        self,
        external_dag_id: str,
        logical_dates: Sequence[dt.datetime] | None = None,
        external_task_ids: Sequence[str] | None = None,
        allowed_states: Sequence[str] = ("success",),
        failed_states: Sequence[str] = (),
        skipped_states: Sequence[str] = (),
        poll_interval: float = 2.0,
        *,
        execution_dates: Sequence[dt.datetime] | None = None,
    ) -> None:
        super().__init__()
        if (logical_dates is None) == (execution_dates is None):
            raise TypeError("give logical_dates or its alias execution_dates, not both")
        self.external_dag_id = external_dag_id
        self.logical_dates = _dates("logical_dates", logical_dates or execution_dates or [])
        self.external_task_ids = None if external_task_ids is None else list(external_task_ids)
        self.allowed_states = [str(state) for state in allowed_states]
        self.failed_states = [str(state) for state in failed_states]
        self.skipped_states = [str(state) for state in skipped_states]
        self.poll_interval = _interval(poll_interval)

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return classpath_of(WorkflowTrigger), {
            "external_dag_id": self.external_dag_id,
            "logical_dates": self.logical_dates,
            "external_task_ids": self.external_task_ids,
            "allowed_states": self.allowed_states,
            "failed_states": self.failed_states,
            "skipped_states": self.skipped_states,
            "poll_interval": self.poll_interval,
        }

    def check(self) -> dict[str, str] | None:
        with metastore().sessions() as session:
            states = read_states(
                session, self.external_dag_id, self.logical_dates, self.external_task_ids
            )
        status: ExternalStatus | None = external_status(
            states,
            self.logical_dates,
            self.external_task_ids,
            allowed=self.allowed_states,
            failed=self.failed_states,
            skipped=self.skipped_states,
        )
        return None if status is None else {"status": status.value}
