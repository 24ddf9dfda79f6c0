"""Task groups: a named set of tasks (and groups) of one DAG whose ids carry the group's id as a
prefix (``group.task``), with default_args of their own, usable as one node in ``>>``."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, ClassVar

from deferral.authoring.dependencies import DependencyMixin
from deferral.dag import DAG
from deferral.exceptions import DagDefinitionError

if TYPE_CHECKING:
    from deferral.authoring.expandinput import ExpandInput
    from deferral.baseoperator import BaseOperator

# As Airflow: no '.', which separates a group's id from its children's.
_GROUP_ID_PATTERN = re.compile(r"^[A-Za-z0-9_\-]{1,200}$")


class TaskGroup(DependencyMixin):
    """``with TaskGroup("extract") as extract:`` — tasks created inside get ids ``extract.<id>``.

    ``group >> other`` wires the group's leaves (its tasks with no downstream inside it) to
    ``other``; ``other >> group`` wires ``other`` to its roots (no upstream inside it).
    """

    _context_stack: ClassVar[list[TaskGroup]] = []

    def __init__(
        self,
        group_id: str,
        prefix_group_id: bool = True,
        parent_group: TaskGroup | None = None,
        dag: DAG | None = None,
        default_args: dict[str, Any] | None = None,
        tooltip: str = "",
        ui_color: str = "CornflowerBlue",
        ui_fgcolor: str = "#000",
        add_suffix_on_collision: bool = False,
    ) -> None:
        if not isinstance(group_id, str) or not _GROUP_ID_PATTERN.match(group_id):
            raise DagDefinitionError(
                f"group_id {group_id!r} is invalid: use 1-200 letters, digits, '_' or '-'"
            )
        found = dag or (parent_group.dag if parent_group else None) or DAG.current()
        if found is None:
            raise DagDefinitionError(
                f"task group {group_id!r} is outside a DAG: create it inside `with DAG(...)`"
                " or pass dag="
            )
        parent = parent_group if parent_group is not None else TaskGroup.current(found)
        if parent is not None and parent.dag is not found:
            raise DagDefinitionError(
                f"task group {group_id!r} and its parent group {parent.group_id!r}"
                " are not in the same DAG"
            )
        if default_args is not None and not isinstance(default_args, dict):
            raise DagDefinitionError(f"task group {group_id!r}: default_args must be a dict")
        self.dag: DAG = found
        self.parent_group = parent
        # A mapped task group's input (``@task_group ... .expand(...)``): what it maps over.
        self.expand_input: ExpandInput | None = None
        self.prefix_group_id = prefix_group_id
        self.tooltip = tooltip
        self.ui_color = ui_color
        self.ui_fgcolor = ui_fgcolor
        # A group's default_args apply over its parent's, which apply over the DAG's.
        self.default_args: dict[str, Any] = {
            **(parent.default_args if parent else {}),
            **(default_args or {}),
        }
        self.children: dict[str, BaseOperator | TaskGroup] = {}
        self._group_id = group_id
        if add_suffix_on_collision:
            self._group_id = found.unique_label(group_id, parent)
        found.add_task_group(self)
        if parent is not None:
            parent.children[self.group_id] = self

    def __repr__(self) -> str:
        return f"<TaskGroup: {self.group_id}>"

    def __deepcopy__(self, memo: dict[int, Any]) -> TaskGroup:
        return self  # part of the DAG's structure, shared by every copy of its tasks

    # -- ids -------------------------------------------------------------------------------------

    @property
    def group_id(self) -> str:
        """The full id: the parent's id as a prefix when the parent prefixes its children."""
        parent = self.parent_group
        return parent.child_id(self._group_id) if parent is not None else self._group_id

    @property
    def label(self) -> str:
        return self._group_id

    def child_id(self, label: str) -> str:
        """The id a child labelled ``label`` gets in this group."""
        return f"{self.group_id}.{label}" if self.prefix_group_id else label

    def innermost_mapped(self) -> TaskGroup | None:
        """The innermost mapped task group this group is in (itself included), if any."""
        group: TaskGroup | None = self
        while group is not None and group.expand_input is None:
            group = group.parent_group
        return group

    # -- context ---------------------------------------------------------------------------------

    def __enter__(self) -> TaskGroup:
        TaskGroup._context_stack.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        TaskGroup._context_stack.pop()

    @classmethod
    def current(cls, dag: DAG | None) -> TaskGroup | None:
        """The innermost group entered with ``with``, if it belongs to ``dag``."""
        if not cls._context_stack:
            return None
        group = cls._context_stack[-1]
        return group if dag is None or group.dag is dag else None

    # -- members ---------------------------------------------------------------------------------

    def add(self, task: BaseOperator) -> None:
        self.children[task.task_id] = task

    def __iter__(self) -> Iterator[BaseOperator]:
        """Every task of the group, nested groups included, in the order they were added."""
        for child in self.children.values():
            if isinstance(child, TaskGroup):
                yield from child
            else:
                yield child

    @property
    def roots(self) -> list[BaseOperator]:
        """Tasks with no upstream task inside the group."""
        tasks = list(self)
        ids = {task.task_id for task in tasks}
        return [task for task in tasks if task.upstream_task_ids.isdisjoint(ids)]

    @property
    def leaves(self) -> list[BaseOperator]:
        """Tasks with no downstream task inside the group; a teardown there stands aside for
        the last work tasks before it, as in Airflow (what follows the group waits for the work,
        not for the clean-up): going up through teardowns, never from a teardown to its setup,
        to the tasks with no other work task downstream inside the group."""
        tasks = list(self)
        by_id = {task.task_id: task for task in tasks}
        found: dict[str, BaseOperator] = {}

        def work_before(teardown: BaseOperator) -> None:
            for up_id in sorted(teardown.upstream_task_ids & by_id.keys()):
                up = by_id[up_id]
                if up.is_teardown:
                    work_before(up)
                elif not up.is_setup and not any(
                    not by_id[down].is_teardown
                    for down in up.downstream_task_ids & by_id.keys()
                    if down != teardown.task_id
                ):
                    found[up_id] = up

        for task in tasks:
            if task.downstream_task_ids.isdisjoint(by_id):
                if task.is_teardown:
                    work_before(task)
                else:
                    found[task.task_id] = task
        return list(found.values())

    def dependency_tasks(self, *, as_upstream: bool) -> list[BaseOperator]:
        tasks = self.leaves if as_upstream else self.roots
        if not tasks:
            raise DagDefinitionError(
                f"task group {self.group_id!r} has no tasks yet: set its dependencies after"
                " adding its tasks"
            )
        return tasks
