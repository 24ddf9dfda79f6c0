"""DAGs: named graphs of tasks, declared in Python files of the DAGs folder."""

from __future__ import annotations

import datetime as dt
import re
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    from deferral.baseoperator import BaseOperator

_ID_PATTERN = re.compile(r"^[A-Za-z0-9_.\-]{1,250}$")


class DagDefinitionError(ValueError):
    """A DAG or task is declared wrongly; the message names which."""


def check_id(kind: str, value: object) -> str:
    if not isinstance(value, str) or not _ID_PATTERN.match(value):
        raise DagDefinitionError(
            f"{kind} {value!r} is invalid: use 1-250 letters, digits, '_', '-' or '.'"
        )
    return value


class DAG:
    _context_stack: ClassVar[list[DAG]] = []

    def __init__(
        self,
        dag_id: str,
        schedule: str | None = None,
        start_date: dt.datetime | None = None,
        default_args: dict[str, Any] | None = None,
        max_active_tasks: int = 16,
        params: dict[str, Any] | None = None,
        description: str | None = None,
    ) -> None:
        self.dag_id = check_id("dag_id", dag_id)
        if schedule is not None:
            raise DagDefinitionError(f"DAG {dag_id!r}: only schedule=None is supported so far")
        self.schedule = schedule
        self.start_date = start_date
        self.default_args = dict(default_args or {})
        self.max_active_tasks = max_active_tasks
        self.params = dict(params or {})
        self.description = description
        self.task_dict: dict[str, BaseOperator] = {}
        self.fileloc: str | None = None

    def __repr__(self) -> str:
        return f"<DAG {self.dag_id}>"

    def __enter__(self) -> DAG:
        DAG._context_stack.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        DAG._context_stack.pop()

    @classmethod
    def current(cls) -> DAG | None:
        return cls._context_stack[-1] if cls._context_stack else None

    @property
    def tasks(self) -> list[BaseOperator]:
        return list(self.task_dict.values())

    def add_task(self, task: BaseOperator) -> None:
        if task.task_id in self.task_dict and self.task_dict[task.task_id] is not task:
            raise DagDefinitionError(f"DAG {self.dag_id!r} has two tasks with id {task.task_id!r}")
        self.task_dict[task.task_id] = task

    def get_task(self, task_id: str) -> BaseOperator:
        try:
            return self.task_dict[task_id]
        except KeyError:
            raise DagDefinitionError(f"DAG {self.dag_id!r} has no task {task_id!r}") from None

    def topological_order(self) -> Iterator[BaseOperator]:
        """Tasks upstream first; raises DagDefinitionError naming a task on a cycle."""
        indegree = {tid: len(t.upstream_task_ids) for tid, t in self.task_dict.items()}
        ready = sorted(tid for tid, n in indegree.items() if n == 0)
        seen = 0
        while ready:
            tid = ready.pop(0)
            seen += 1
            yield self.task_dict[tid]
            for down in sorted(self.task_dict[tid].downstream_task_ids):
                indegree[down] -= 1
                if indegree[down] == 0:
                    ready.append(down)
        if seen != len(self.task_dict):
            raise DagDefinitionError(
                f"DAG {self.dag_id!r} has a cycle through {self._task_on_cycle(indegree)!r}"
            )

    def _task_on_cycle(self, indegree: dict[str, int]) -> str:
        """Every unvisited task has an unvisited upstream task, so walking upstream among them
        must come back to a task already passed: that task is on a cycle."""
        unvisited = {tid for tid, n in indegree.items() if n > 0}
        current, passed = min(unvisited), set()
        while current not in passed:
            passed.add(current)
            current = min(self.task_dict[current].upstream_task_ids & unvisited)
        return current

    def downstream_of(self, task_id: str) -> set[str]:
        """Every task reachable downstream of ``task_id``."""
        found: set[str] = set()
        pending = [task_id]
        while pending:
            for down in self.get_task(pending.pop()).downstream_task_ids - found:
                found.add(down)
                pending.append(down)
        return found

    def validate(self) -> None:
        for _ in self.topological_order():
            pass
