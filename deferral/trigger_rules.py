"""Trigger rules: when a task may run, given the states of its upstream tasks.

Pure functions, used by the scheduler and tested on their own.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from enum import StrEnum

from deferral.states import FINISHED_STATES, TaskState


class TriggerRule(StrEnum):
    ALL_SUCCESS = "all_success"
    ALL_FAILED = "all_failed"
    ALL_DONE = "all_done"
    ONE_FAILED = "one_failed"
    ONE_SUCCESS = "one_success"
    NONE_FAILED = "none_failed"
    NONE_FAILED_MIN_ONE_SUCCESS = "none_failed_min_one_success"
    NONE_SKIPPED = "none_skipped"
    ALWAYS = "always"
    # A teardown's (deferral.authoring.setup_teardown): all upstream done, and a setup among them
    # succeeded.
    ALL_DONE_SETUP_SUCCESS = "all_done_setup_success"


# The states of a run's task instances: task_id -> map_index -> state. A task that is not mapped
# has map index -1 only, as does a mapped task until it is expanded into map indexes 0..n-1.
RunStates = Mapping[str, Mapping[int, str]]


def upstream_states(upstream_task_ids: Iterable[str], states: RunStates) -> list[str]:
    """The states a trigger rule counts, as Airflow counts them: every task instance of each
    upstream task (every map index of a mapped one), removed map indexes left out. An upstream
    task without a task instance (added to the DAG mid-run) has not run yet (none); one whose
    every map index was removed counts as skipped."""
    found: list[str] = []
    for task_id in sorted(upstream_task_ids):
        mine = list(states.get(task_id, {-1: TaskState.NONE}).values())
        kept = [s for s in mine if s != TaskState.REMOVED]
        found += kept if kept or not mine else [TaskState.SKIPPED]
    return found


def setups_gate(setup_states: Iterable[str]) -> TaskState | None:
    """What a work task's indirect setups (``deferral.authoring.setup_teardown``) say, before its
    trigger
    rule: UPSTREAM_FAILED if one failed, SKIPPED if one was skipped, None until every one
    succeeded, then SCHEDULED (the trigger rule decides)."""
    states = {TaskState(s) for s in setup_states}
    if states & {TaskState.FAILED, TaskState.UPSTREAM_FAILED}:
        return TaskState.UPSTREAM_FAILED
    if TaskState.SKIPPED in states:
        return TaskState.SKIPPED
    return TaskState.SCHEDULED if states <= {TaskState.SUCCESS} else None


def evaluate(
    rule: TriggerRule, upstream_states: Iterable[str], setup_states: Iterable[str] = ()
) -> TaskState | None:
    """Decide a waiting task's next state from its upstream states (``setup_states``: those of
    its direct upstream setup tasks, which ``all_done_setup_success`` also counts).

    Returns SCHEDULED (run it), SKIPPED or UPSTREAM_FAILED (never run it), or None (not yet:
    some upstream task has not finished and the rule cannot be decided early).
    """
    states = [TaskState(s) for s in upstream_states]
    count = Counter(states)
    total = len(states)
    done = sum(n for s, n in count.items() if s in FINISHED_STATES)
    success = count[TaskState.SUCCESS]
    failed = count[TaskState.FAILED] + count[TaskState.UPSTREAM_FAILED]
    skipped = count[TaskState.SKIPPED]
    all_done = done == total
    run, skip, fail = TaskState.SCHEDULED, TaskState.SKIPPED, TaskState.UPSTREAM_FAILED

    if rule is TriggerRule.ALWAYS or total == 0:
        return run
    if rule is TriggerRule.ALL_SUCCESS:
        if failed:
            return fail
        if skipped:
            return skip
        return run if all_done else None
    if rule is TriggerRule.ALL_FAILED:
        if success or skipped:
            return skip
        return run if all_done else None
    if rule is TriggerRule.ALL_DONE:
        return run if all_done else None
    if rule is TriggerRule.ONE_FAILED:
        if failed:
            return run
        return skip if all_done else None
    if rule is TriggerRule.ONE_SUCCESS:
        if success:
            return run
        if not all_done:
            return None
        return fail if failed else skip
    if rule is TriggerRule.NONE_FAILED:
        if failed:
            return fail
        return run if all_done else None
    if rule is TriggerRule.NONE_FAILED_MIN_ONE_SUCCESS:
        if failed:
            return fail
        if not all_done:
            return None
        return run if success else skip
    if rule is TriggerRule.ALL_DONE_SETUP_SUCCESS:
        if not all_done:
            return None
        setups = [TaskState(s) for s in setup_states]
        if setups and all(s is TaskState.SKIPPED for s in setups):
            return skip
        if setups and TaskState.SUCCESS not in setups:
            return fail
        return run
    if rule is TriggerRule.NONE_SKIPPED:
        if skipped:
            return skip
        return run if all_done else None
    raise ValueError(f"unknown trigger rule {rule!r}")
