"""Dynamic task mapping in the scheduler: a mapped task waits as one placeholder task instance
(map index -1) until its trigger rule lets it run and the tasks it maps over have finished;
then it is expanded into map indexes 0..n-1 (n from the shapes of those tasks' XComs), skipped
when n is 0, or failed, naming the argument, when its input cannot be mapped or is longer than
``DEFERRAL_MAX_MAP_LENGTH``. A mapped task cleared after its expansion is revised the same way
when it may run again: map indexes its input no longer has are removed, new ones created.

:class:`Expansions` decides (pure, given the shapes read by :func:`read_shapes`); :func:`carry_out`
applies a decision through ``deferral.store.transitions``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import and_, case, func, select, tuple_
from sqlalchemy.orm import Session

from deferral.authoring.expandinput import Shape, XComRef
from deferral.authoring.mappedoperator import MappedOperator
from deferral.baseoperator import BaseOperator
from deferral.dag import DAG
from deferral.exceptions import MappingError
from deferral.runtime.serialization import TAG
from deferral.states import FINISHED_STATES, TaskState
from deferral.store import transitions
from deferral.store.tables import DagRun, TaskInstance, XCom
from deferral.store.transitions import NewTaskInstance
from deferral.trigger_rules import RunStates
from scheduler.decide import RunTask

TI = TaskInstance

# What the caller makes of one new task instance of a mapped task: (task, map index) -> row.
NewTaskInstanceOf = Callable[[BaseOperator, int], NewTaskInstance]


@dataclass(frozen=True)
class Expansion:
    """What a mapped task's input gives now: its length, or why it cannot be mapped."""

    length: int = 0
    error: str | None = None


class Expansions:
    """The expansion decisions of one run's mapped tasks, given the shapes of the XComs they
    map over (pure). :meth:`decide` is the ``mapped`` hook of
    ``scheduler.decide.waiting_task_decisions``; it keeps the reason of each decision."""

    def __init__(self, shapes: Mapping[XComRef, Shape], max_length: int) -> None:
        self.shapes = shapes
        self.max_length = max_length
        self.reasons: dict[str, str] = {}

    def expansion(self, task: MappedOperator) -> Expansion:
        where = f"task {task.task_id!r}"
        try:
            length = task.expand_input.length(self.shapes, where)
        except MappingError as exc:
            return Expansion(error=str(exc))
        if length > self.max_length:
            return Expansion(
                error=f"{where} would expand into {length} task instances, more than"
                f" DEFERRAL_MAX_MAP_LENGTH ({self.max_length})"
            )
        return Expansion(length)

    def decide(
        self, task: BaseOperator, rule: TaskState | None, states: RunStates
    ) -> TaskState | None:
        """A mapped task whose trigger rule says ``rule``: upstream_failed or skipped as soon as
        a task it maps over failed or was skipped before expanding (as Airflow's
        MappedTaskUpstreamDep); otherwise as the rule says, except that it runs (expands) only
        once every task it maps over has finished, and is skipped when there is nothing to map
        over, failed when its input cannot be mapped."""
        assert isinstance(task, MappedOperator)
        decision, reason = self._decide(task, rule, states)
        if decision is not None:
            self.reasons[task.task_id] = reason
        return decision

    def _decide(
        self, task: MappedOperator, rule: TaskState | None, states: RunStates
    ) -> tuple[TaskState | None, str]:
        dependencies = sorted(task.mapped_dependencies())
        unexpanded = {states.get(d, {}).get(-1) for d in dependencies}
        if unexpanded & {TaskState.FAILED, TaskState.UPSTREAM_FAILED}:
            return TaskState.UPSTREAM_FAILED, "a task it maps over failed"
        if TaskState.SKIPPED in unexpanded:
            return TaskState.SKIPPED, "a task it maps over was skipped"
        if rule is not TaskState.SCHEDULED:
            return rule, "trigger rule"
        for dependency in dependencies:
            mine = states.get(dependency, {}).values()
            if not mine or any(TaskState(s) not in FINISHED_STATES for s in mine):
                return None, ""
        expansion = self.expansion(task)
        if expansion.error is not None:
            return TaskState.FAILED, expansion.error
        if expansion.length == 0:
            return TaskState.SKIPPED, f"nothing to map over: {task.expand_input!r} is empty"
        return TaskState.SCHEDULED, f"expanded into {expansion.length} task instance(s)"


def shape_of_stored(kind: str, tag: str | None, length: int | None, scalar: Any) -> Shape:
    """The shape of a stored XCom value (tagged JSON, see deferral.runtime.serialization) from what
    SQL says of it: its JSON type, its type tag, its length, and its value if a scalar."""
    if kind == "array":
        return Shape("list", length)
    if kind == "object":
        if tag is None:
            return Shape("dict", length)
        return Shape(tag, length if tag == "tuple" else None)
    return Shape.of(scalar)


def _wanted_refs(dag: DAG, states: RunStates) -> set[XComRef]:
    """The XComs mapped over by the mapped tasks that have a task instance waiting."""
    refs: set[XComRef] = set()
    for task_id, by_index in states.items():
        task = dag.task_dict.get(task_id)
        if isinstance(task, MappedOperator) and TaskState.NONE in by_index.values():
            refs |= {(a.operator.task_id, a.key) for a in task.expand_input.xcom_args()}
    return refs


def read_shapes(session: Session, run: DagRun, dag: DAG, states: RunStates) -> dict[XComRef, Shape]:
    """The shapes of the XComs the run's waiting mapped tasks map over, computed in SQL (the
    values themselves are never read here): one statement, none when no mapped task waits. A
    mapped upstream task's XCom is the list of its map indexes' values."""
    refs = _wanted_refs(dag, states)
    if not refs:
        return {}
    kind = func.jsonb_typeof(XCom.value)
    tag = XCom.value.op("->>")(TAG)
    keys = select(func.count()).select_from(func.jsonb_object_keys(XCom.value)).scalar_subquery()
    length = case(
        (kind == "array", func.jsonb_array_length(XCom.value)),
        (and_(kind == "object", tag == "tuple"), func.jsonb_array_length(XCom.value["items"])),
        (and_(kind == "object", tag.is_(None)), keys),
    )
    scalar = case((kind.not_in(["array", "object"]), XCom.value))
    rows = session.execute(
        select(TI.task_id, TI.map_index, XCom.key, kind, tag, length, scalar)
        .join(TI, TI.id == XCom.task_instance_id)
        .where(
            TI.dag_id == run.dag_id,
            TI.run_id == run.run_id,
            tuple_(TI.task_id, XCom.key).in_(sorted(refs)),
        )
    ).all()
    shapes: dict[XComRef, Shape] = {}
    counts: dict[XComRef, int] = {}
    for task_id, map_index, key, *stored in rows:
        if map_index < 0:
            shapes[(task_id, key)] = shape_of_stored(*stored)
        else:
            counts[(task_id, key)] = counts.get((task_id, key), 0) + 1
    for ref, count in counts.items():
        shapes[ref] = Shape("list", count)
    return shapes


@dataclass(frozen=True)
class Move:
    """Task instances of one task to move from none to ``to_state`` for ``reason``."""

    to_state: TaskState
    reason: str
    ids: list[int]


def carry_out(
    session: Session,
    run: DagRun,
    task: MappedOperator,
    tis: Sequence[RunTask],
    decision: TaskState,
    expansions: Expansions,
    new_ti: NewTaskInstanceOf,
    *,
    schedule: bool = True,
) -> tuple[list[tuple[int, int]], list[Move]]:
    """Apply ``decision`` to the waiting task instances (state none) among a mapped task's
    ``tis``: expand the placeholder (its map indexes scheduled, or left waiting without
    ``schedule``), or revise the map indexes of an expanded task, when it runs; otherwise move
    them all. Returns the task instances created or moved to another map index (id, map index)
    and the moves still to make."""
    reason = expansions.reasons.get(task.task_id, "trigger rule")
    # Waiting task instances are read as rows (an upstream count is never of state none).
    waiting = [ti for ti in tis if ti.state == TaskState.NONE and ti.id is not None]
    if decision is not TaskState.SCHEDULED:
        return [], [Move(decision, reason, _ids(waiting))]
    length = expansions.expansion(task).length
    placeholder = next((ti for ti in waiting if ti.map_index < 0), None)
    if placeholder is not None:
        more = [new_ti(task, index) for index in range(1, length)]
        assert placeholder.id is not None
        expanded = transitions.expand_mapped_task(session, run, placeholder.id, more)
        if not schedule:
            return expanded, []
        return expanded, [Move(decision, reason, [ti_id for ti_id, _ in expanded])]
    # Expanded before and cleared since: its input may have another length now.
    existing = {ti.map_index for ti in tis}
    created = transitions.add_task_instances(
        session, run, [new_ti(task, i) for i in range(length) if i not in existing]
    )
    kept = _ids(ti for ti in waiting if ti.map_index < length) + [ti_id for ti_id, _ in created]
    beyond = _ids(ti for ti in waiting if ti.map_index >= length)
    removed = f"its input now gives {length} value(s): no value for this map index"
    return created, [Move(decision, reason, kept), Move(TaskState.REMOVED, removed, beyond)]


def _ids(tis: Iterable[RunTask]) -> list[int]:
    return [ti.id for ti in tis if ti.id is not None]
