"""Pure decisions of the scheduler, tested on their own."""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from deferral import trigger_rules
from deferral.dag import DAG
from deferral.states import FAILED_STATES, FINISHED_STATES, DagRunState, TaskState


def waiting_task_decisions(dag: DAG, states: Mapping[str, str]) -> dict[str, TaskState]:
    """For every task in state none, what its trigger rule says now (scheduled, skipped or
    upstream_failed); undecided tasks are left out. Decisions cascade within one call: a task
    marked upstream_failed makes its own downstream decidable at once."""
    current = dict(states)
    decisions: dict[str, TaskState] = {}
    for task in dag.topological_order():
        if current.get(task.task_id) != TaskState.NONE:
            continue
        # An upstream task without a task instance (added to the DAG mid-run) has not run yet.
        upstream = [current.get(t, TaskState.NONE) for t in task.upstream_task_ids]
        decision = trigger_rules.evaluate(task.trigger_rule, upstream)
        if decision is not None:
            decisions[task.task_id] = decision
            current[task.task_id] = decision
    return decisions


def dag_run_outcome(dag: DAG, states: Mapping[str, str]) -> DagRunState | None:
    """None while any task can still change; then failed if a leaf task failed, else success."""
    if any(TaskState(s) not in FINISHED_STATES for s in states.values()):
        return None
    leaves = [t.task_id for t in dag.tasks if not t.downstream_task_ids]
    if any(states.get(leaf) in FAILED_STATES for leaf in leaves):
        return DagRunState.FAILED
    return DagRunState.SUCCESS


def retry_due(now: dt.datetime, failed_at: dt.datetime | None, retry_delay: dt.timedelta) -> bool:
    return failed_at is None or failed_at + retry_delay <= now


@dataclass(frozen=True)
class Ready:
    """A scheduled task instance waiting for a slot."""

    id: int
    pool: str
    pool_slots: int
    priority_weight: int


def choose_dispatch(
    ready: Sequence[Ready], run_budget: int, pool_free: Mapping[str, int]
) -> list[int]:
    """Which ready tasks to queue now: highest priority first, at most ``run_budget`` of them,
    each only if its pool has ``pool_slots`` free (a task whose pool is unknown waits).
    A task too big for what its pool has left does not block smaller ones behind it."""
    free = dict(pool_free)
    chosen: list[int] = []
    for task in sorted(ready, key=lambda t: (-t.priority_weight, t.id)):
        if len(chosen) >= run_budget:
            break
        if free.get(task.pool, 0) >= task.pool_slots:
            free[task.pool] -= task.pool_slots
            chosen.append(task.id)
    return chosen


def reschedule_due(now: dt.datetime, reschedule_date: dt.datetime) -> bool:
    return reschedule_date <= now


def dispatch_budget(max_active_tasks: int, states: Mapping[str, str]) -> int:
    """How many more tasks of one run may be queued or running now."""
    active = sum(1 for s in states.values() if s in (TaskState.QUEUED, TaskState.RUNNING))
    return max(0, max_active_tasks - active)
