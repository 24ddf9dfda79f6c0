"""``@task_group``: a function whose call builds a task group around the tasks it creates, and
whose ``.expand(name=values)`` builds a mapped one.

A mapped task group maps each of its TaskFlow tasks over the group's values: a task called with
the group's argument (a ``MappedArgument``) is mapped over ``values``, and one called with the
result of another task of the group is mapped over that task's results, so map index i of every
task of the group is the i-th value's. (Airflow runs map index i of a task as soon as map index
i of its upstream is done; here a task of the group starts once all of its upstream's are.)"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

from deferral.authoring.expandinput import is_mappable_literal
from deferral.authoring.mappedoperator import MappedOperator
from deferral.exceptions import DagDefinitionError
from deferral.utils.task_group import TaskGroup
from deferral.xcom_arg import XComArg


class MappedArgument:
    """Inside ``@task_group ... .expand(name=values)``: the group's argument ``name``, which a
    task of the group is mapped over (``values``: a list, a dict or an upstream XComArg)."""

    def __init__(self, group: TaskGroup, name: str, values: Any) -> None:
        self.group = group
        self.name = name
        self.values = values

    def __repr__(self) -> str:
        return f"MappedArgument({self.group.group_id!r}, {self.name!r})"


def mapped_group_of(group: TaskGroup | None) -> TaskGroup | None:
    """The innermost mapped task group ``group`` is in (itself included), if any."""
    while group is not None:
        if group.mapped_argument is not None:
            return group
        group = group.parent_group
    return None


def _in_group(task: Any, group: TaskGroup) -> bool:
    inner: TaskGroup | None = getattr(task, "task_group", None)
    while inner is not None:
        if inner is group:
            return True
        inner = inner.parent_group
    return False


def group_mapped_values(group: TaskGroup, where: str, arguments: dict[str, Any]) -> dict[str, Any]:
    """Of a task's ``arguments`` inside mapped ``group``, those it is mapped over: the group's
    argument (mapped over its values) and another task of the group's result (over that task's
    results). At most one: deferral maps a group's task over one argument."""
    mapped = {
        name: value.values if isinstance(value, MappedArgument) else value
        for name, value in arguments.items()
        if isinstance(value, MappedArgument)
        or (isinstance(value, XComArg) and _in_group(value.operator, group))
    }
    if len(mapped) > 1:
        raise DagDefinitionError(
            f"{where} of mapped task group {group.group_id!r}: mapped over {sorted(mapped)};"
            " deferral maps a task of a mapped group over one argument"
        )
    return mapped


class TaskGroupDecorator:
    """Each call creates a TaskGroup (id: the function's name, ``name__1`` on the second call)
    and runs the function inside it. The call returns what the function returns (e.g. the
    XComArg of its last task, to chain on), or the group itself if it returns None."""

    def __init__(self, function: Callable[..., Any], group_kwargs: dict[str, Any]) -> None:
        self.function = function
        self.group_kwargs = group_kwargs
        functools.update_wrapper(self, function)

    def override(self, **kwargs: Any) -> TaskGroupDecorator:
        return TaskGroupDecorator(self.function, {**self.group_kwargs, **kwargs})

    def partial(self, **kwargs: Any) -> PartialTaskGroup:
        """A mapped group's arguments every map index shares; then ``.expand(name=values)``."""
        return PartialTaskGroup(self, kwargs)

    def expand(self, **mapped: Any) -> TaskGroup:
        """A mapped task group: its tasks run once per value of the one argument given (a
        list, a dict or an upstream XComArg). Returns the group."""
        return self.partial().expand(**mapped)

    def _group(self) -> TaskGroup:
        options = dict(self.group_kwargs)
        group_id = options.pop("group_id", None) or self.function.__name__
        group = TaskGroup(group_id, add_suffix_on_collision=True, **options)
        if self.function.__doc__ and not group.tooltip:
            group.tooltip = inspect.cleandoc(self.function.__doc__)
        return group

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with self._group() as group:
            returned = self.function(*args, **kwargs)
        return group if returned is None else returned


class PartialTaskGroup:
    """``@task_group`` function with the arguments every map index shares (``.partial(...)``)."""

    def __init__(self, decorator: TaskGroupDecorator, kwargs: dict[str, Any]) -> None:
        self.decorator = decorator
        self.kwargs = kwargs

    def expand(self, **mapped: Any) -> TaskGroup:
        where = f"task group {self.decorator.function.__name__!r}"
        if len(mapped) != 1:
            raise DagDefinitionError(
                f"{where}: deferral maps a task group over one argument, got {len(mapped)}"
                f" ({', '.join(sorted(mapped)) or 'none'})"
            )
        ((name, values),) = mapped.items()
        if not isinstance(values, XComArg) and not is_mappable_literal(values):
            raise DagDefinitionError(
                f"{where}: expand({name}=...) takes a list, a dict or an XComArg,"
                f" got {type(values).__name__}"
            )
        with self.decorator._group() as group:
            argument = MappedArgument(group, name, values)
            group.mapped_argument = argument
            self.decorator.function(**self.kwargs, **{name: argument})
        for task in group:
            if not isinstance(task, MappedOperator):
                raise DagDefinitionError(
                    f"task {task.task_id!r} of mapped task group {group.group_id!r} takes"
                    f" neither {name!r} nor another of its tasks' results: deferral maps each"
                    " task of a mapped group over one of them"
                )
        return group


def task_group(python_callable: Callable[..., Any] | None = None, **group_kwargs: Any) -> Any:
    """``@task_group`` or ``@task_group(group_id=..., prefix_group_id=..., default_args=...,
    tooltip=...)``."""

    def decorate(function: Callable[..., Any]) -> TaskGroupDecorator:
        if not callable(function):
            raise DagDefinitionError(f"@task_group decorates a function, not {function!r}")
        return TaskGroupDecorator(function, group_kwargs)

    if python_callable is None:
        return decorate
    if not callable(python_callable):
        raise DagDefinitionError(
            f"@task_group takes a function and keyword arguments only, got {python_callable!r}"
            " (the group id is the function's name, or group_id=...)"
        )
    return decorate(python_callable)
