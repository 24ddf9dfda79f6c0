"""``@task_group``: a function whose call builds a task group around the tasks it creates, and
whose ``.expand(...)``, ``.partial(...).expand(...)`` or ``.expand_kwargs(...)`` builds a mapped
one, as Airflow's ``MappedTaskGroup``.

A mapped task group has an input (the cartesian product of ``expand``'s arguments, or one dict
of ``expand_kwargs`` per map index); its function gets a ``MappedArgument`` for each argument
not given to ``partial``. Each TaskFlow task the function calls is mapped with the group
(``GroupMappedInput``): one map index per value of the group's input, map index i reading the
group's arguments at i and, from another task of the group, that task's value at i. The
scheduler runs map index i of a task once the map index i of its upstream tasks in the group
is done (``scheduler.decide``); a task outside the group waits for all of them, and reads the
list of their values."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from collections.abc import Set as AbstractSet
from typing import Any

from deferral.authoring.expandinput import (
    DictOfListsExpandInput,
    ExpandInput,
    GroupMappedInput,
    ListOfDictsExpandInput,
    MappedArgument,
)
from deferral.authoring.mappedoperator import MappedOperator, check_expand, check_expand_kwargs
from deferral.exceptions import DagDefinitionError
from deferral.utils.task_group import TaskGroup
from deferral.xcom_arg import RETURN_VALUE_KEY


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

    def expand(self, **mapped: Any) -> Any:
        """A mapped task group: its tasks run once per combination of the arguments' values
        (their cartesian product; each a list, a dict or an upstream XComArg). Returns what
        the function returns, or the group if that is None."""
        return self.partial().expand(**mapped)

    def expand_kwargs(self, kwargs: Any) -> Any:
        """A mapped task group: its tasks run once per dict of arguments (a list of dicts, or
        an upstream XComArg holding one). Returns as :meth:`expand`."""
        return self.partial().expand_kwargs(kwargs)

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
        self.where = f"task group {decorator.function.__name__!r}"
        parameters = inspect.signature(decorator.function).parameters.values()
        self.parameters = {
            p.name: p for p in parameters if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
        }
        open_ended = any(p.kind is p.VAR_KEYWORD for p in parameters)
        self.varargs = any(p.kind is p.VAR_POSITIONAL for p in parameters)
        self.mappable = None if open_ended else frozenset(self.parameters)
        for name in kwargs:
            if self.mappable is not None and name not in self.mappable:
                raise DagDefinitionError(
                    f"{self.where}: partial() got an unexpected argument {name!r}"
                )

    def expand(self, **mapped: Any) -> Any:
        call = f"{self.decorator.function.__name__}.expand"
        check_expand(self.where, call, mapped, self.mappable, self.kwargs)
        return self._build(call, DictOfListsExpandInput(mapped), set(mapped))

    def expand_kwargs(self, kwargs: Any) -> Any:
        call = f"{self.decorator.function.__name__}.expand_kwargs"
        if self.mappable is None or self.varargs:
            raise DagDefinitionError(
                f"{self.where}: {call}() cannot map a function taking *args or **kwargs"
            )
        check_expand_kwargs(self.where, call, kwargs, self.mappable, self.kwargs)
        # As Airflow: every argument not given to partial() is the group's, defaults or not.
        return self._build(call, ListOfDictsExpandInput(kwargs), self.mappable - set(self.kwargs))

    def _build(self, call: str, expand_input: ExpandInput, names: AbstractSet[str]) -> Any:
        """Run the function inside the new group, each of ``names`` a MappedArgument; the tasks
        of the group's input become upstream of its roots. Returns what the function returns
        (its last task's XComArg, say), or the group if that is None, as Airflow."""
        for arg in expand_input.xcom_args():
            if arg.key != RETURN_VALUE_KEY:
                raise DagDefinitionError(
                    f"{self.where}: {call}() maps over XCom {arg.key!r} of task"
                    f" {arg.operator.task_id!r}: a task group maps over return values only"
                )
        with self.decorator._group() as group:
            group.expand_input = expand_input
            arguments = {
                name: MappedArgument(group.group_id, expand_input, name) for name in sorted(names)
            }
            returned = self.decorator.function(**self.kwargs, **arguments)
        for task in group:
            mine = isinstance(task, MappedOperator) and isinstance(
                task.expand_input, GroupMappedInput
            )
            inner = task.task_group.innermost_mapped() if task.task_group else None
            if not mine or inner is not group:
                raise DagDefinitionError(
                    f"task {task.task_id!r} of mapped task group {group.group_id!r}: deferral"
                    " maps only the @task calls of a mapped group (not a classic operator, an"
                    " .expand() of its own or a nested mapped group)"
                )
        upstream = {arg.operator.task_id: arg.operator for arg in expand_input.runtime_args()}
        for root in group.roots:
            for task in upstream.values():
                root.set_upstream(task)
        return group if returned is None else returned


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
