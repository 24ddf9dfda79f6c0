"""``>>`` and ``<<`` between tasks, XComArgs and task groups, and lists of them.

Each kind of node names the tasks that stand for it: a task stands for itself, an XComArg for
the task that pushes it, a task group for its leaves when upstream and for its roots when
downstream. Wiring is always task to task.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from deferral.dag import DagDefinitionError

if TYPE_CHECKING:
    from deferral.baseoperator import BaseOperator


class DependencyMixin:
    """Anything that may stand on either side of ``>>`` / ``<<``."""

    def dependency_tasks(self, *, as_upstream: bool) -> list[BaseOperator]:
        """The tasks this node stands for, as an upstream (True) or a downstream (False)."""
        raise NotImplementedError

    def set_downstream(self, other: Any) -> None:
        relate(self, other)

    def set_upstream(self, other: Any) -> None:
        relate(other, self)

    def __rshift__(self, other: Any) -> Any:
        relate(self, other)
        return other

    def __lshift__(self, other: Any) -> Any:
        relate(other, self)
        return other

    def __rrshift__(self, other: Any) -> Any:
        # [a, b] >> self
        relate(other, self)
        return self

    def __rlshift__(self, other: Any) -> Any:
        # [a, b] << self
        relate(self, other)
        return self


def is_node_list(value: object) -> bool:
    return isinstance(value, list | tuple | set | frozenset)


def tasks_of(node: Any, *, as_upstream: bool) -> list[BaseOperator]:
    """The tasks a node (or a list of nodes) stands for."""
    if isinstance(node, DependencyMixin):
        return node.dependency_tasks(as_upstream=as_upstream)
    if is_node_list(node):
        return [task for item in node for task in tasks_of(item, as_upstream=as_upstream)]
    raise DagDefinitionError(
        f"cannot set a dependency on {node!r}: not a task, a task group or an XComArg"
    )


def relate(upstream: Any, downstream: Any) -> None:
    """``upstream >> downstream`` for any nodes or lists of nodes."""
    downs = tasks_of(downstream, as_upstream=False)
    for up in tasks_of(upstream, as_upstream=True):
        for down in downs:
            up.add_downstream_task(down)
