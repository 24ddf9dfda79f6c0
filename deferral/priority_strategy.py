"""Airflow 3's ``weight_rule``: how a task instance's priority weight is worked out when its run
creates it (``airflow.task.priority_strategy``).

``"absolute"`` (deferral's default) takes the task's ``priority_weight`` as it is; a
:class:`PriorityWeightStrategy` (an instance, or the dotted path of its class) computes it from
the new task instance. Airflow asks for a custom strategy to be registered by a plugin because
its scheduler rebuilds tasks from their serialized form and may import only registered classes;
deferral's scheduler runs the DAG file itself, so the strategy is the task's own object, as a
DAG file's own timetable is (DECISIONS.md 16)."""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from deferral.baseoperator import BaseOperator

ABSOLUTE = "absolute"
# Airflow's rules that sum the weights up or down the graph.
NOT_YET = frozenset({"downstream", "upstream"})


@dataclass(frozen=True)
class TaskInstanceDraft:
    """What a strategy's ``get_weight`` reads: the task instance about to be created (no try
    yet: ``try_number`` 0, as in Airflow)."""

    dag_id: str
    run_id: str
    task_id: str
    map_index: int
    task: BaseOperator
    try_number: int = 0


class PriorityWeightStrategy(ABC):
    """A task's ``weight_rule``: ``get_weight`` gives the priority weight of each of its task
    instances. Stateless, as Airflow keeps no parameters of it: instances of one class are
    equal."""

    @abstractmethod
    def get_weight(self, ti: Any) -> int:
        """The priority weight of ``ti`` (a :class:`TaskInstanceDraft`)."""

    def __eq__(self, other: object) -> bool:
        return isinstance(other, type(self))

    def __hash__(self) -> int:
        return hash(type(self))


class DecreasingPriorityStrategy(PriorityWeightStrategy):
    """The strategy of Airflow's example plugin (``example_custom_weight.py``): 4 for a task
    instance with no try yet, one less a try, never below 1."""

    def get_weight(self, ti: Any) -> int:
        return max(4 - (ti.try_number or 0), 1)


def weight_rule_error(value: Any) -> str | None:
    """Why ``value`` is no weight rule deferral honours, or None."""
    if value is None or value == ABSOLUTE or isinstance(value, PriorityWeightStrategy):
        return None
    if value in NOT_YET:
        return (
            "deferral orders by priority_weight as given ('absolute') or by a "
            "PriorityWeightStrategy; summing it up or down the graph is not implemented by "
            "deferral yet"
        )
    if not isinstance(value, str):
        return "it must be 'absolute', a PriorityWeightStrategy or its class's dotted path"
    module, _, name = value.rpartition(".")
    try:
        found = getattr(importlib.import_module(module), name) if module else None
    except (ImportError, AttributeError) as exc:
        return f"its class does not import: {exc}"
    if not (isinstance(found, type) and issubclass(found, PriorityWeightStrategy)):
        return f"{value} is not a PriorityWeightStrategy subclass"
    return None


def load_weight_rule(value: Any) -> str | PriorityWeightStrategy:
    """``value`` (checked by :func:`weight_rule_error`) as the task keeps it: ``"absolute"`` or
    a strategy instance."""
    if value is None or value == ABSOLUTE or isinstance(value, PriorityWeightStrategy):
        return value or ABSOLUTE
    module, _, name = value.rpartition(".")
    strategy: PriorityWeightStrategy = getattr(importlib.import_module(module), name)()
    return strategy


def priority_weight(task: BaseOperator, ti: TaskInstanceDraft) -> int:
    """The priority weight of ``ti``, a new task instance of ``task``."""
    rule = getattr(task, "weight_rule", ABSOLUTE)
    if not isinstance(rule, PriorityWeightStrategy):
        return task.priority_weight
    weight = rule.get_weight(ti)
    if isinstance(weight, bool) or not isinstance(weight, int):
        raise TypeError(
            f"{type(rule).__name__}.get_weight returned {weight!r} for task {task.task_id!r}, "
            "not an int"
        )
    return weight
