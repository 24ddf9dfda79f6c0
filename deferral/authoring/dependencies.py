"""``>>`` and ``<<`` between tasks, XComArgs and task groups, and lists of them.

Each kind of node names the tasks that stand for it: a task stands for itself, an XComArg for
the task that pushes it, a task group for its leaves when upstream and for its roots when
downstream. Wiring is always task to task.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from deferral.exceptions import DagDefinitionError

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


class EdgeModifier(DependencyMixin):
    """Stands between tasks on an edge and describes it (``a >> Label("yes") >> b``): it keeps
    what was set upstream of it, and wires that to what is set downstream of it, recording its
    ``label`` on each edge it makes (``DAG.get_edge_info``). Airflow's ``EdgeModifier``."""

    def __init__(self, label: str | None = None) -> None:
        self.label = label
        self._upstream: list[Any] = []

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.label!r}>"

    def dependency_tasks(self, *, as_upstream: bool) -> list[BaseOperator]:
        raise DagDefinitionError(f"{self!r} must stand between tasks")

    def wire(self, downstream: Any) -> None:
        """Make every node set upstream of this one upstream of ``downstream``, labelled."""
        if not self._upstream:
            raise DagDefinitionError(f"{self!r} has nothing upstream of it to connect")
        downs = tasks_of(downstream, as_upstream=False)
        for node in self._upstream:
            for up in tasks_of(node, as_upstream=True):
                for down in downs:
                    up.add_downstream_task(down)
                    if up.dag is not None:
                        up.dag.set_edge_info(up.task_id, down.task_id, {"label": self.label})


def relate(upstream: Any, downstream: Any) -> None:
    """``upstream >> downstream`` for any nodes or lists of nodes."""
    if isinstance(downstream, EdgeModifier):
        downstream._upstream.append(upstream)
        return
    if isinstance(upstream, EdgeModifier):
        upstream.wire(downstream)
        return
    downs = tasks_of(downstream, as_upstream=False)
    for up in tasks_of(upstream, as_upstream=True):
        for down in downs:
            up.add_downstream_task(down)
