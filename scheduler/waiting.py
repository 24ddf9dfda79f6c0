"""What the scheduler does with a run's waiting task instances (state none) when it evaluates
the run: the trigger rules' decisions (``decide.waiting_decisions``, over every map index
of mapped upstream tasks), mapped tasks expanded on the way (``scheduler.mapping``), all applied
through ``deferral.store.transitions``."""

from __future__ import annotations

import datetime as dt
import functools
from collections.abc import Sequence
from dataclasses import dataclass, field

from sqlalchemy.orm import Session

from deferral.authoring.mappedoperator import MappedOperator
from deferral.baseoperator import BaseOperator
from deferral.dag import DAG
from deferral.loading.policies import apply_task_instance_mutation_hook
from deferral.priority_strategy import TaskInstanceDraft, priority_weight
from deferral.states import TaskState
from deferral.store import transitions
from deferral.store.tables import DagRun
from deferral.store.transitions import NewTaskInstance
from scheduler import decide, mapping, runstate
from scheduler.mapping import Move, NewTaskInstanceOf


@dataclass
class Advanced:
    """What an evaluation moved: how many task instances, and which of them to scheduled."""

    moved: int = 0
    scheduled: list[int] = field(default_factory=list)
    # Tasks of mapped task groups expanded: their map indexes wait to be decided.
    expanded: int = 0


def advance(
    session: Session,
    run: DagRun,
    dag: DAG,
    tis: Sequence[decide.RunTask],
    new_ti: NewTaskInstanceOf,
    max_map_length: int,
) -> Advanced:
    """Schedule, skip or fail the run's waiting task instances as their trigger rules say,
    expanding mapped tasks that may run; ``tis`` are the waiting ones and what their upstream
    tasks count (``scheduler.runstate.undecided``). Returns what moved.
    Moves of one kind and reason are one statement."""
    states = decide.run_states(tis)
    expansions = mapping.Expansions(mapping.read_shapes(session, run, dag, states), max_map_length)
    held = _held_by_past(session, run, dag, states)
    decisions = decide.waiting_decisions(dag, states, expansions.decide, held)
    of_task: dict[str, list[decide.RunTask]] = {}
    for ti in tis:
        of_task.setdefault(ti.task_id, []).append(ti)
    moves: list[Move] = []
    advanced = Advanced()
    for task_id, decision in decisions.tasks.items():
        mine = of_task[task_id]
        task = dag.task_dict[task_id]
        if isinstance(task, MappedOperator):
            # A mapped group's task expands into map indexes that are decided one by one.
            by_index = decide.mapped_group_members(task) is not None
            expanded, task_moves = mapping.carry_out(
                session, run, task, mine, decision, expansions, new_ti, schedule=not by_index
            )
            moves += task_moves
            if by_index and expanded:
                advanced.expanded += 1
                advanced.moved += len(expanded)
        else:
            waiting = [ti.id for ti in mine if ti.state == TaskState.NONE and ti.id is not None]
            met = decision is TaskState.SCHEDULED
            moves.append(Move(decision, "dependencies met" if met else "trigger rule", waiting))
    waiting_ids = {(ti.task_id, ti.map_index): ti.id for ti in tis if ti.state == TaskState.NONE}
    for key, decision in decisions.indexes.items():
        met = decision is TaskState.SCHEDULED
        reason = "dependencies met at this map index" if met else "trigger rule at this map index"
        ti_id = waiting_ids.get(key)
        moves.append(Move(decision, reason, [] if ti_id is None else [ti_id]))
    grouped: dict[tuple[TaskState, str], list[int]] = {}
    for move in moves:
        grouped.setdefault((move.to_state, move.reason), []).extend(move.ids)
    for (to_state, reason), ids in grouped.items():
        if to_state == TaskState.SCHEDULED:
            moved = transitions.schedule(session, ids, reason)
            advanced.scheduled += moved
        else:
            moved = transitions.never_run(session, ids, to_state, reason)
        advanced.moved += len(moved)
    return advanced


def _held_by_past(
    session: Session, run: DagRun, dag: DAG, states: decide.RunStates
) -> frozenset[str]:
    """The waiting ``depends_on_past`` tasks whose previous run does not let them run yet
    (``decide.past_depends_met``); the previous run is read only if such a task waits."""
    waiting = sorted(
        task_id
        for task_id in decide.past_dependent_tasks(dag) & states.keys()
        if TaskState.NONE in states[task_id].values()
    )
    if not waiting:
        return frozenset()
    previous = runstate.previous_run(session, dag, run, waiting)
    return frozenset(
        task_id
        for task_id in waiting
        if not decide.past_depends_met(dag.task_dict[task_id], previous, catchup=dag.catchup)
    )


def advance_runs(session: Session, runs: Sequence[tuple[DagRun, DAG]]) -> dict[int, Advanced]:
    """:func:`advance_run` of many runs at once, for DAGs ``decide.decidable_together``: their
    undecided task instances read in one go (``runstate.undecided_of_runs``), each run decided
    by ``decide.waiting_decisions``, and the moves of every run of one kind and reason made in
    one statement. Returns what moved in each run, by the run's id."""
    if not runs:
        return {}
    found = runstate.undecided_of_runs(
        session, [(dag, run.dag_id, run.run_id) for run, dag in runs]
    )
    run_of: dict[int, int] = {}
    grouped: dict[tuple[TaskState, str], list[int]] = {}
    due: dict[int, dt.datetime] = {}
    now = dt.datetime.now(dt.UTC)
    for run, dag in runs:
        tis = found[(run.dag_id, run.run_id)]
        decisions = decide.waiting_decisions(dag, decide.run_states(tis))
        for ti in tis:
            if ti.id is not None:
                run_of[ti.id] = run.id
        for task_id, decision in decisions.tasks.items():
            met = decision is TaskState.SCHEDULED
            grouped.setdefault(
                (decision, "dependencies met" if met else "trigger rule"), []
            ).extend(
                ti.id
                for ti in tis
                if ti.task_id == task_id and ti.state == TaskState.NONE and ti.id is not None
            )
        due |= _retries_due(dag, tis, now)
    advanced = {run.id: Advanced() for run, _ in runs}
    for (to_state, reason), ids in grouped.items():
        if to_state == TaskState.SCHEDULED:
            moved = transitions.schedule(session, ids, reason)
        else:
            moved = transitions.never_run(session, ids, to_state, reason)
        for ti_id in moved:
            of_run = advanced[run_of[ti_id]]
            of_run.moved += 1
            if to_state == TaskState.SCHEDULED:
                of_run.scheduled.append(ti_id)
    transitions.set_retry_due(session, due)
    return advanced


def _retries_due(
    dag: DAG, tis: Sequence[decide.RunTask], now: dt.datetime
) -> dict[int, dt.datetime]:
    """The due time of each retry among ``tis`` failed without one (its worker stopped)."""
    return {
        ti.id: decide.next_try_at(ti.end_date, dag.task_dict[ti.task_id].retry_delay, now)
        for ti in tis
        if ti.id is not None
        and ti.state == TaskState.UP_FOR_RETRY
        and ti.due_at is None
        and ti.task_id in dag.task_dict
    }


def advance_run(session: Session, run: DagRun, dag: DAG, max_map_length: int) -> Advanced:
    """:func:`advance` over the run's undecided task instances, and the due time of each retry
    failed without one (its worker stopped): what a run's evaluation moves before it asks
    whether the run ended."""
    tis = runstate.undecided(session, dag, run.dag_id, run.run_id)
    new_ti = functools.partial(new_task_instance, run)
    advanced = advance(session, run, dag, tis, new_ti, max_map_length)
    while advanced.expanded:  # the new map indexes of mapped groups' tasks are decided now
        tis = runstate.undecided(session, dag, run.dag_id, run.run_id)
        more = advance(session, run, dag, tis, new_ti, max_map_length)
        advanced = Advanced(
            advanced.moved + more.moved, advanced.scheduled + more.scheduled, more.expanded
        )
    transitions.set_retry_due(session, _retries_due(dag, tis, dt.datetime.now(dt.UTC)))
    return advanced


def new_task_instance(run: DagRun, task: BaseOperator, map_index: int = -1) -> NewTaskInstance:
    """The task instance of ``task`` (at ``map_index``) a run gets, as the cluster policy's
    task_instance_mutation_hook leaves it."""
    new = NewTaskInstance(
        task_id=task.task_id,
        max_tries=task.retries,
        pool=task.pool,
        pool_slots=task.pool_slots,
        queue=task.queue,
        priority_weight=priority_weight(
            task, TaskInstanceDraft(run.dag_id, run.run_id, task.task_id, map_index, task)
        ),
        map_index=map_index,
    )
    return apply_task_instance_mutation_hook(new, dag_id=run.dag_id, run_id=run.run_id, task=task)
