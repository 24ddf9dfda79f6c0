"""Task-instance and DAG-run states."""

from __future__ import annotations

import datetime as dt
from enum import StrEnum


class TaskState(StrEnum):
    NONE = "none"
    SCHEDULED = "scheduled"
    QUEUED = "queued"
    RUNNING = "running"
    DEFERRED = "deferred"
    # Waits for a person's response (HITLOperator): no worker, pool slot or trigger held.
    AWAITING_INPUT = "awaiting_input"
    UP_FOR_RESCHEDULE = "up_for_reschedule"
    UP_FOR_RETRY = "up_for_retry"
    SUCCESS = "success"
    FAILED = "failed"
    SKIPPED = "skipped"
    UPSTREAM_FAILED = "upstream_failed"
    REMOVED = "removed"


FINISHED_STATES = frozenset(
    {
        TaskState.SUCCESS,
        TaskState.FAILED,
        TaskState.SKIPPED,
        TaskState.UPSTREAM_FAILED,
        TaskState.REMOVED,
    }
)
FAILED_STATES = frozenset({TaskState.FAILED, TaskState.UPSTREAM_FAILED})


class DagRunState(StrEnum):
    QUEUED = "queued"
    RUNNING = "running"
    SUCCESS = "success"
    FAILED = "failed"


class DagRunType(StrEnum):
    """Who made a run: a user (``dags trigger``), the scheduler, or ``dags backfill``."""

    MANUAL = "manual"
    SCHEDULED = "scheduled"
    BACKFILL = "backfill"
    ASSET_TRIGGERED = "asset_triggered"

    def run_id(self, logical_date: dt.datetime) -> str:
        """Airflow's run ids: ``scheduled__2024-01-01T00:00:00+00:00``."""
        return f"{self.value}__{logical_date.isoformat()}"


# Runs the scheduler's "latest automated run" counts from (manual runs never move the schedule).
AUTOMATED_RUN_TYPES = frozenset({DagRunType.SCHEDULED, DagRunType.BACKFILL})


# next_method value the scheduler sets when a deferral ends without its trigger firing: the
# worker then raises TaskDeferralTimeout / TaskDeferralError inside the task instead of resuming.
FAIL_METHOD = "__fail__"


# The event kinds (``deferral:events`` field ``kind``) of the three task-end events: the state
# a trigger's task-end event ends its task in. Vocabulary of every layer (the broker checks the
# field, the store applies it, triggers yield it), so it lives with the states.
END_KINDS = {
    TaskState.SUCCESS: "task_success",
    TaskState.FAILED: "task_failed",
    TaskState.SKIPPED: "task_skipped",
}
