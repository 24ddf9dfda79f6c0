"""Branching: a task that chooses which of its directly-downstream tasks run.

The choice is carried, as the task ids to skip, to the worker, which skips them in the same
transaction as the branch task's success; trigger rules then carry the skip further.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from deferral.baseoperator import BaseOperator
from deferral.context import Context


def branch_skips(task: BaseOperator, chosen: Any) -> set[str]:
    """The directly-downstream tasks of ``task`` to skip when it chose ``chosen``: a task id or
    task group id (standing for the group's roots), a list of them, or None (skip them all).
    A task downstream of a chosen one is never skipped (``branch >> [a, join]; a >> join``
    with ``a`` chosen keeps ``join``), as in Airflow."""
    where = f"branch task {task.task_id!r}"
    if chosen is None:
        targets: list[Any] = []
    elif isinstance(chosen, str):
        targets = [chosen]
    elif isinstance(chosen, Iterable) and not isinstance(chosen, bytes | dict):
        targets = list(chosen)
    else:
        raise TypeError(
            f"{where} returned {chosen!r}: expected a task id, a task group id,"
            " a list of them, or None"
        )
    dag = task.dag
    assert dag is not None
    followed: set[str] = set()
    for target in targets:
        if not isinstance(target, str):
            raise TypeError(f"{where} returned {target!r} among its branches: not a task id")
        if target in dag.task_group_dict:
            followed.update(root.task_id for root in dag.task_group_dict[target].roots)
        elif target in dag.task_dict:
            followed.add(target)
        else:
            raise ValueError(
                f"{where} chose {target!r}, which is neither a task nor a task group"
                f" of DAG {dag.dag_id!r}"
            )
    for task_id in list(followed):
        followed |= dag.downstream_of(task_id)
    return task.downstream_task_ids - followed


class BaseBranchOperator(BaseOperator):
    """Subclass and implement ``choose_branch(context)``, returning what BranchPythonOperator's
    callable returns."""

    def choose_branch(self, context: Context) -> str | Iterable[str] | None:
        raise NotImplementedError(f"{type(self).__name__} must implement choose_branch()")

    def execute(self, context: Context) -> Any:
        chosen = self.choose_branch(context)
        context["ti"].skip_task_ids.update(branch_skips(self, chosen))
        return chosen
