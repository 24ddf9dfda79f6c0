"""Setup and teardown tasks, as Airflow 2.10 defines them (AIP-52).

A setup task makes something the work needs (a cluster, a table); a teardown task removes it. A
teardown runs once the tasks upstream of it are done, whatever their outcome, as long as one of
its setups succeeded (trigger rule ``all_done_setup_success``), and does not decide the run's
state unless ``on_failure_fail_dagrun``. A work task whose setup (however far upstream) failed
or was skipped does not run, whatever its trigger rule. Clearing a work task clears the setups
it needs and their teardowns.

Here: marking tasks (``as_setup`` / ``as_teardown``), the ``with setup >> teardown:`` scope,
and the pure graph questions the scheduler and the clearing actions ask (computed once per DAG
object).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from deferral.authoring.dependencies import relate, tasks_of
from deferral.exceptions import DagDefinitionError
from deferral.trigger_rules import TriggerRule

if TYPE_CHECKING:
    from deferral.baseoperator import BaseOperator
    from deferral.dag import DAG


def mark_setup(task: BaseOperator) -> None:
    if task.is_teardown:
        raise DagDefinitionError(
            f"task {task.task_id!r} cannot be a setup task: it is already a teardown task"
        )
    task.is_setup = True


def mark_teardown(
    task: BaseOperator, setups: Any = None, on_failure_fail_dagrun: bool | None = None
) -> None:
    """``task`` as a teardown (trigger rule ``all_done_setup_success``) of ``setups`` (tasks,
    XComArgs or lists of them; each becomes a setup task upstream of it)."""
    if task.is_setup:
        raise DagDefinitionError(
            f"task {task.task_id!r} cannot be a teardown task: it is already a setup task"
        )
    if on_failure_fail_dagrun is not None and not isinstance(on_failure_fail_dagrun, bool):
        raise DagDefinitionError(
            f"task {task.task_id!r}: on_failure_fail_dagrun must be True or False"
        )
    task.is_teardown = True
    task.trigger_rule = TriggerRule.ALL_DONE_SETUP_SUCCESS
    if on_failure_fail_dagrun is not None:
        task.on_failure_fail_dagrun = on_failure_fail_dagrun
    if setups is not None:
        for setup in tasks_of(setups, as_upstream=True):
            mark_setup(setup)
            relate(setup, task)


# -- with setup >> teardown: ... -------------------------------------------------------------------


@dataclass
class _Scope:
    setups: list[BaseOperator]
    teardowns: list[BaseOperator]
    tasks: list[BaseOperator] = field(default_factory=list)


_scopes: list[_Scope] = []


def enter_scope(task: BaseOperator) -> None:
    """``with s >> t:`` (``t`` a teardown: its setups are the setups upstream of it) or ``with
    s:`` (``s`` a setup: its teardowns are the teardowns downstream of it)."""
    dag = task.dag
    if task.is_teardown and dag is not None:
        setups = [dag.task_dict[t] for t in sorted(task.upstream_task_ids)]
        _scopes.append(_Scope([s for s in setups if s.is_setup], [task]))
    elif task.is_setup and dag is not None:
        downs = [dag.task_dict[t] for t in sorted(task.downstream_task_ids)]
        _scopes.append(_Scope([task], [d for d in downs if d.is_teardown]))
    else:
        raise DagDefinitionError(
            f"task {task.task_id!r} is used as a context manager, which only setup and teardown"
            " tasks can be"
        )


def exit_scope(*, wire: bool) -> None:
    """The work tasks created in the scope go between its setups and teardowns: the ones with no
    upstream task among them after the setups, the ones with no downstream task among them
    before the teardowns (unless the block raised: ``wire`` False)."""
    scope = _scopes.pop()
    if not wire:
        return
    own = {id(t) for t in (*scope.setups, *scope.teardowns)}
    work = [t for t in scope.tasks if id(t) not in own]
    ids = {t.task_id for t in work}
    for task in work:
        if task.upstream_task_ids.isdisjoint(ids):
            relate(scope.setups, task)
        if task.downstream_task_ids.isdisjoint(ids):
            relate(task, scope.teardowns)


def record(task: BaseOperator) -> None:
    """A task was added to a DAG: the open ``with setup >> teardown:`` scopes hold it."""
    for scope in _scopes:
        scope.tasks.append(task)


# -- what the scheduler and clearing ask of a DAG ------------------------------------------------


@dataclass(frozen=True)
class SetupTeardownGraph:
    """Of each task: its relevant setups (``upstream_setups``), and which tasks decide the run's
    state (``deciding_leaves``)."""

    upstream_setups: dict[str, frozenset[str]]
    deciding_leaves: frozenset[str]

    def indirect_setups(self, task: BaseOperator) -> frozenset[str]:
        """The relevant setups of a work task that are not directly upstream of it: all must
        succeed before it runs (its trigger rule judges the direct ones)."""
        if task.is_teardown:
            return frozenset()
        return self.upstream_setups.get(task.task_id, frozenset()) - task.upstream_task_ids


_GRAPHS: weakref.WeakKeyDictionary[DAG, SetupTeardownGraph] = weakref.WeakKeyDictionary()


def graph(dag: DAG) -> SetupTeardownGraph:
    found = _GRAPHS.get(dag)
    if found is None:
        found = _GRAPHS[dag] = _graph(dag)
    return found


def _graph(dag: DAG) -> SetupTeardownGraph:
    setups = {t.task_id for t in dag.tasks if t.is_setup}
    upstream_setups: dict[str, frozenset[str]] = {}
    if setups:
        for task in dag.tasks:
            relevant = relevant_setups(dag, task)
            if relevant:
                upstream_setups[task.task_id] = frozenset(relevant)
    return SetupTeardownGraph(upstream_setups, frozenset(_deciding_leaves(dag)))


def _relatives(dag: SetupGraph, task_id: str, *, upstream: bool) -> set[str]:
    found: set[str] = set()
    pending = [task_id]
    while pending:
        task = dag.task_dict[pending.pop()]
        for other in (task.upstream_task_ids if upstream else task.downstream_task_ids) - found:
            found.add(other)
            pending.append(other)
    return found


def relevant_setups(dag: SetupGraph, task: GraphTask) -> list[str]:
    """The setups upstream of ``task`` (at any depth) whose scope it is in: a setup with no
    teardown, or with a teardown downstream of ``task`` (Airflow's
    ``get_upstreams_only_setups``)."""
    teardowns_below = {
        t for t in _relatives(dag, task.task_id, upstream=False) if dag.task_dict[t].is_teardown
    }
    found = []
    for up in sorted(_relatives(dag, task.task_id, upstream=True)):
        candidate = dag.task_dict[up]
        if not candidate.is_setup:
            continue
        its_teardowns = {d for d in candidate.downstream_task_ids if dag.task_dict[d].is_teardown}
        if not its_teardowns or its_teardowns & teardowns_below:
            found.append(up)
    return found


def _deciding_leaves(dag: DAG) -> set[str]:
    """The tasks whose failure fails the run: those with no downstream task but teardowns that
    do not decide, themselves not such a teardown (all leaves, if only teardowns are left)."""

    def ignored(task: BaseOperator) -> bool:
        return task.is_teardown and not task.on_failure_fail_dagrun

    leaves = {
        task.task_id
        for task in dag.tasks
        if not ignored(task)
        and all(ignored(dag.task_dict[down]) for down in task.downstream_task_ids)
    }
    return leaves or {task.task_id for task in dag.tasks if not task.downstream_task_ids}


class GraphTask(Protocol):
    """What a clear reads of a task: an operator, or a task of a DAG's parsed document."""

    @property
    def task_id(self) -> str: ...
    @property
    def upstream_task_ids(self) -> set[str]: ...
    @property
    def downstream_task_ids(self) -> set[str]: ...
    @property
    def is_setup(self) -> bool: ...
    @property
    def is_teardown(self) -> bool: ...
    @property
    def retries(self) -> int: ...


class SetupGraph(Protocol):
    """What finding the setups and teardowns a clear brings reads of a DAG: its tasks."""

    @property
    def task_dict(self) -> Mapping[str, GraphTask]: ...


def clearing_with(dag: SetupGraph, task_ids: Iterable[str], *, downstream: bool) -> set[str]:
    """What clearing ``task_ids`` (with their downstream tasks if ``downstream``) clears, as
    Airflow 2.10: each work task brings its relevant setups and their teardowns; a setup
    cleared alone brings its teardowns."""
    chosen = set(task_ids)
    if downstream:
        for task_id in list(chosen):
            chosen |= _relatives(dag, task_id, upstream=False)
    extra: set[str] = set()
    for task_id in chosen:
        task = dag.task_dict[task_id]
        if task.is_setup:
            if not downstream:
                extra |= {d for d in task.downstream_task_ids if dag.task_dict[d].is_teardown}
        elif not task.is_teardown:
            for setup in relevant_setups(dag, task):
                extra.add(setup)
                extra |= {
                    d
                    for d in dag.task_dict[setup].downstream_task_ids
                    if dag.task_dict[d].is_teardown
                }
    return chosen | extra


def check(dag: DAG) -> None:
    """Airflow's rule: a setup task's downstream work tasks keep the trigger rule
    ``all_success``, so that clearing one behaves the same whatever the run's history."""
    for task in dag.tasks:
        if not task.is_setup:
            continue
        for down_id in sorted(task.downstream_task_ids):
            down = dag.task_dict[down_id]
            if not down.is_teardown and down.trigger_rule != TriggerRule.ALL_SUCCESS:
                raise DagDefinitionError(
                    f"DAG {dag.dag_id!r}: task {down_id!r} is downstream of setup task"
                    f" {task.task_id!r} and must keep trigger_rule 'all_success', not"
                    f" {str(down.trigger_rule)!r}",
                    line=dag.defined_at_line,
                )
