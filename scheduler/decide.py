"""Pure decisions of the scheduler, tested on their own."""

from __future__ import annotations

import datetime as dt
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from typing import NamedTuple, Protocol

from deferral import trigger_rules
from deferral.authoring import setup_teardown
from deferral.baseoperator import BaseOperator
from deferral.dag import DAG
from deferral.states import FAILED_STATES, FINISHED_STATES, DagRunState, DagRunType, TaskState
from deferral.trigger_rules import RunStates


class HasState(Protocol):
    """A task instance as decisions see it."""

    @property
    def task_id(self) -> str: ...

    @property
    def map_index(self) -> int: ...

    @property
    def state(self) -> str: ...


class RunTask(NamedTuple):
    """A task instance as a run's evaluation reads it: the columns it needs, in a plain row
    rather than an ORM object. ``id`` None: one of the task instances an upstream count stands
    for (``scheduler.runstate.undecided``), which the evaluation counts but never moves."""

    id: int | None
    task_id: str
    map_index: int
    state: str
    due_at: dt.datetime | None
    end_date: dt.datetime | None


def run_states(tis: Iterable[HasState]) -> dict[str, dict[int, str]]:
    """A run's task instances as task_id -> map_index -> state."""
    states: dict[str, dict[int, str]] = {}
    for ti in tis:
        states.setdefault(ti.task_id, {})[ti.map_index] = ti.state
    return states


# What decides a mapped task once its trigger rule has spoken (scheduler.mapping.Expansions):
# (task, the rule's decision, the run's states so far) -> the decision, or None to wait.
MappedDecision = Callable[[BaseOperator, TaskState | None, RunStates], TaskState | None]


_POSITIONS: weakref.WeakKeyDictionary[DAG, dict[str, int]] = weakref.WeakKeyDictionary()


def topological_positions(dag: DAG) -> dict[str, int]:
    """Each task's place in ``dag.topological_order()``, computed once per DAG object."""
    found = _POSITIONS.get(dag)
    if found is None:
        found = {task.task_id: i for i, task in enumerate(dag.topological_order())}
        _POSITIONS[dag] = found
    return found


class Decisions(NamedTuple):
    """What :func:`waiting_decisions` decided: for whole tasks (every waiting task instance of
    each), and for single map indexes of the expanded tasks of mapped task groups."""

    tasks: dict[str, TaskState]
    indexes: dict[tuple[str, int], TaskState]


def mapped_group_members(task: BaseOperator) -> frozenset[str] | None:
    """The task ids of the mapped task group ``task`` is mapped with (its innermost), if any."""
    group = task.task_group.innermost_mapped() if task.task_group is not None else None
    return None if group is None else frozenset(member.task_id for member in group)


def relevant_upstream_states(
    task: BaseOperator, members: frozenset[str], map_index: int, states: RunStates
) -> list[str]:
    """The upstream states map index ``map_index`` of a task of a mapped task group counts, as
    Airflow's relevant upstream map indexes: an upstream task of the same group at that map
    index only (its placeholder's state while it is not expanded; a removed index counts as
    skipped), any other upstream task at every map index."""
    found = trigger_rules.upstream_states(task.upstream_task_ids - members, states)
    for upstream_id in sorted(task.upstream_task_ids & members):
        theirs = states.get(upstream_id, {})
        state = theirs.get(map_index, theirs.get(-1, TaskState.NONE))
        found.append(TaskState.SKIPPED if state == TaskState.REMOVED else state)
    return found


def waiting_task_decisions(
    dag: DAG,
    states: RunStates,
    mapped: MappedDecision | None = None,
    held: AbstractSet[str] = frozenset(),
) -> dict[str, TaskState]:
    """The decisions of :func:`waiting_decisions` for whole tasks."""
    return waiting_decisions(dag, states, mapped, held).tasks


def waiting_decisions(
    dag: DAG,
    states: RunStates,
    mapped: MappedDecision | None = None,
    held: AbstractSet[str] = frozenset(),
) -> Decisions:
    """For every task with a task instance in state none, what its trigger rule says now
    (scheduled, skipped or upstream_failed), counting every map index of a mapped upstream
    task; undecided tasks are left out. For a mapped task, ``mapped`` has the last word (its
    expansion may wait, skip or fail it). Decisions cascade within one call: a task marked
    upstream_failed makes its own downstream decidable at once. A work task's indirect setups
    (``deferral.authoring.setup_teardown``) are judged before its trigger rule. A task in ``held``
    (its previous run's task is not done: :func:`past_depends_met`) is not scheduled; its
    trigger rule still fails it, and skips it unless ``wait_for_past_depends_before_skipping``.

    A task of a mapped task group is decided by map index once expanded, each counting its
    upstream tasks of the group at its own map index (:func:`relevant_upstream_states`); before
    that, its placeholder counts only its upstream tasks outside the group, and a scheduled
    placeholder means expand it (its map indexes then wait to be decided)."""
    current = {task_id: dict(by_index) for task_id, by_index in states.items()}
    decided = Decisions({}, {})
    # Only the tasks with task instances at hand, upstream first: an evaluation reads the
    # waiting tasks and their upstream counts, not the whole run, nor walks the whole DAG.
    position = topological_positions(dag)
    setups = setup_teardown.graph(dag)
    for task_id in sorted((t for t in current if t in position), key=position.__getitem__):
        task = dag.task_dict[task_id]
        mine = current.get(task.task_id, {})
        if TaskState.NONE not in mine.values():
            continue
        members = mapped_group_members(task)
        if members is not None and mine.get(-1) != TaskState.NONE:
            for index, state in sorted(mine.items()):
                if state != TaskState.NONE:
                    continue
                upstream = relevant_upstream_states(task, members, index, current)
                decision = _rule_decision(dag, task, upstream, current, setups)
                if decision is not None and not _held_back(task, decision, held):
                    decided.indexes[(task_id, index)] = mine[index] = decision
            continue
        ids = task.upstream_task_ids if members is None else task.upstream_task_ids - members
        upstream = trigger_rules.upstream_states(ids, current)
        decision = _rule_decision(dag, task, upstream, current, setups)
        if _held_back(task, decision, held):
            continue
        if mapped is not None and task.is_mapped:
            decision = mapped(task, decision, current)
        if decision is not None:
            decided.tasks[task.task_id] = decision
            if members is None or decision is not TaskState.SCHEDULED:
                current[task.task_id] = {
                    index: decision if state == TaskState.NONE else state
                    for index, state in mine.items()
                }
    return decided


def _rule_decision(
    dag: DAG,
    task: BaseOperator,
    upstream: list[str],
    current: RunStates,
    setups: setup_teardown.SetupTeardownGraph,
) -> TaskState | None:
    """What the task's indirect setups, then its trigger rule over ``upstream``, say."""
    indirect = setups.indirect_setups(task)
    decision = (
        trigger_rules.setups_gate(trigger_rules.upstream_states(indirect, current))
        if indirect
        else TaskState.SCHEDULED
    )
    if decision is TaskState.SCHEDULED:
        direct_setups = [u for u in task.upstream_task_ids if dag.task_dict[u].is_setup]
        decision = trigger_rules.evaluate(
            task.trigger_rule, upstream, trigger_rules.upstream_states(direct_setups, current)
        )
    return decision


def _held_back(task: BaseOperator, decision: TaskState | None, held: AbstractSet[str]) -> bool:
    """A ``held`` task is not scheduled (nor skipped, if it waits for the past to skip)."""
    return task.task_id in held and (
        decision is TaskState.SCHEDULED
        or (decision is TaskState.SKIPPED and task.wait_for_past_depends_before_skipping)
    )


@dataclass(frozen=True)
class PreviousRun:
    """What ``depends_on_past`` reads of the run before (``scheduler.runstate.previous_run``):
    its logical date, the states of the task instances of the tasks asked about (every map
    index), and which of those tasks had a task instance in any earlier run (asked only for
    ``ignore_first_depends_on_past`` tasks the previous run lacks)."""

    logical_date: dt.datetime
    states: Mapping[str, Sequence[str]]
    ran_earlier: AbstractSet[str] = frozenset()


# What Airflow counts as a previous task instance that lets the next one run.
_PAST_DONE = frozenset({TaskState.SUCCESS, TaskState.SKIPPED})


def past_depends_met(task: BaseOperator, previous: PreviousRun | None, *, catchup: bool) -> bool:
    """Whether ``task`` may run as far as its previous run goes, as Airflow 2.10's
    ``PrevDagrunDep``: always without ``depends_on_past``, or without a previous run (the
    previous *scheduled or backfill* run with ``catchup``, any run otherwise), or when that run
    is before the task's start date (with ``catchup``). Otherwise every task instance of the
    task in that run succeeded or was skipped, and with ``wait_for_downstream`` those of its
    direct downstream tasks too. A previous run without the task holds it, unless
    ``ignore_first_depends_on_past`` and no earlier run had it."""
    if not task.depends_on_past or previous is None:
        return True
    start = task.dag.start_date if task.dag is not None else None
    if catchup and start is not None and previous.logical_date < start:
        return True
    mine = previous.states.get(task.task_id, ())
    if not mine:
        return task.ignore_first_depends_on_past and task.task_id not in previous.ran_earlier
    if any(state not in _PAST_DONE for state in mine):
        return False
    return not task.wait_for_downstream or all(
        state in _PAST_DONE
        for down in task.downstream_task_ids
        for state in previous.states.get(down, ())
    )


_PAST_DEPENDENT: weakref.WeakKeyDictionary[DAG, frozenset[str]] = weakref.WeakKeyDictionary()


def past_dependent_tasks(dag: DAG) -> frozenset[str]:
    """The ids of the tasks of ``dag`` that wait on the previous run, found once per DAG
    object (an evaluation must not walk every task of the DAG)."""
    found = _PAST_DEPENDENT.get(dag)
    if found is None:
        found = frozenset(task.task_id for task in dag.tasks if task.depends_on_past)
        _PAST_DEPENDENT[dag] = found
    return found


_TOGETHER: weakref.WeakKeyDictionary[DAG, bool] = weakref.WeakKeyDictionary()


def decidable_together(dag: DAG) -> bool:
    """Whether runs of ``dag`` may be evaluated in one batch (``scheduler.evaluation``): no task
    maps (an expansion inserts task instances and is decided again) and none waits on the
    previous run (it reads that run). Found once per DAG object."""
    found = _TOGETHER.get(dag)
    if found is None:
        found = not past_dependent_tasks(dag) and not any(
            task.is_mapped or mapped_group_members(task) is not None for task in dag.tasks
        )
        _TOGETHER[dag] = found
    return found


@dataclass(frozen=True)
class RunProbes:
    """Index probes of a run's unfinished task instances, read for every marked run before
    deciding whether anything of it must be read (``scheduler.runstate.probes``)."""

    waiting: bool  # a task instance in state none: its trigger rule may now be met
    retries_undue: bool  # up_for_retry without a due time yet
    unfinished: bool


def needs_evaluation(probes: RunProbes, *, checked_against_dag: bool) -> bool:
    """Whether evaluating the run could change anything: a task waits on its trigger rule, a
    retry needs its due time, the run may be over, or the run has not been checked against its
    DAG's tasks yet (a task may have joined). Otherwise nothing can be decided and nothing of
    the run is read."""
    return (
        probes.waiting or probes.retries_undue or not probes.unfinished or not checked_against_dag
    )


def tasks_of_run(
    dag: DAG, run_type: str, logical_date: dt.datetime | None
) -> Sequence[BaseOperator]:
    """The tasks a run gets task instances of, as Airflow's ``verify_integrity``: none when
    its logical date is before the DAG's start_date or after its end_date (a backfill's run
    excepted), so a run triggered outside the DAG's dates runs nothing and succeeds. (A task's
    own dates, other than its DAG's, are refused at parse: the DAG's decide for every task.)"""
    if run_type == DagRunType.BACKFILL or logical_date is None:
        return dag.tasks
    if (dag.start_date is not None and logical_date < dag.start_date) or (
        dag.end_date is not None and logical_date > dag.end_date
    ):
        return ()
    return dag.tasks


def run_outcome(*, unfinished: bool, leaf_failed: bool) -> DagRunState | None:
    """None while any task instance can still change; then failed if a task instance of a
    leaf task (any map index) failed, else success. The leaves are those that decide the run
    (``setup_teardown.SetupTeardownGraph.deciding_leaves``: teardowns and what only they follow
    count only with ``on_failure_fail_dagrun``)."""
    if unfinished:
        return None
    return DagRunState.FAILED if leaf_failed else DagRunState.SUCCESS


def dag_run_outcome(dag: DAG, states: RunStates) -> DagRunState | None:
    """:func:`run_outcome` of a run whose every state is at hand."""
    leaves = setup_teardown.graph(dag).deciding_leaves
    return run_outcome(
        unfinished=any(
            TaskState(s) not in FINISHED_STATES for tis in states.values() for s in tis.values()
        ),
        leaf_failed=any(
            s in FAILED_STATES for leaf in leaves for s in states.get(leaf, {}).values()
        ),
    )


def next_try_at(
    failed_at: dt.datetime | None, retry_delay: dt.timedelta, now: dt.datetime
) -> dt.datetime:
    """When a try failed at ``failed_at`` may be retried (now, if its end was not recorded)."""
    return now if failed_at is None else failed_at + retry_delay


RunKey = tuple[str, str]  # (dag_id, run_id)


@dataclass(frozen=True)
class Ready:
    """A scheduled task instance waiting for a slot."""

    id: int
    run: RunKey
    pool: str
    pool_slots: int
    priority_weight: int
    # Resumed by its event (or an answer): it has a next method to run (scheduler rule 33).
    resumed: bool = False


def dispatch_key(task: Ready, *, resumed_first: bool) -> tuple[int, bool, int]:
    """Dispatch order: highest priority weight first; among equal weights, resumed tasks
    ahead of new work when ``resumed_first`` (``DEFERRAL_RESUMED_FIRST``); then the oldest."""
    return (-task.priority_weight, not (resumed_first and task.resumed), task.id)


@dataclass(frozen=True)
class DispatchPlan:
    """Which ready tasks to queue, and what their pools and runs have left after them."""

    chosen: list[int]
    pool_free: dict[str, int]
    run_budget: dict[RunKey, int]


def plan_dispatch(
    ready: Sequence[Ready],
    run_budget: Mapping[RunKey, int],
    pool_free: Mapping[str, int],
    *,
    resumed_first: bool,
) -> DispatchPlan:
    """Which ready tasks to queue now: in :func:`dispatch_key` order, at most ``run_budget[run]`` of
    each run, each only if its pool has ``pool_slots`` free (a task whose pool is unknown
    waits). A task too big for what its pool has left does not block smaller ones behind it."""
    free = dict(pool_free)
    budget = dict(run_budget)
    chosen: list[int] = []
    for task in sorted(ready, key=lambda t: dispatch_key(t, resumed_first=resumed_first)):
        if budget.get(task.run, 0) <= 0:
            continue
        if free.get(task.pool, 0) >= task.pool_slots:
            free[task.pool] -= task.pool_slots
            budget[task.run] -= 1
            chosen.append(task.id)
    return DispatchPlan(chosen, free, budget)


def choose_dispatch(
    ready: Sequence[Ready],
    run_budget: Mapping[RunKey, int],
    pool_free: Mapping[str, int],
    *,
    resumed_first: bool,
) -> list[int]:
    """The tasks :func:`plan_dispatch` queues."""
    return plan_dispatch(ready, run_budget, pool_free, resumed_first=resumed_first).chosen


def dispatch_budget(max_active_tasks: int, active: int) -> int:
    """How many more tasks of one run may be queued or running now, ``active`` being so."""
    return max(0, max_active_tasks - active)
