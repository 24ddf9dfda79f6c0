"""``@task_group``: a function whose call builds a task group around the tasks it creates."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any, NoReturn

from deferral.exceptions import DagDefinitionError
from deferral.utils.task_group import TaskGroup


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

    def expand(self, **kwargs: Any) -> NoReturn:
        raise DagDefinitionError(
            f"task group {self.function.__name__!r}: mapped task groups "
            "(@task_group ... .expand / .partial().expand) are not supported by deferral"
        )

    partial = expand  # a partial group is only for mapping

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        options = dict(self.group_kwargs)
        group_id = options.pop("group_id", None) or self.function.__name__
        with TaskGroup(group_id, add_suffix_on_collision=True, **options) as group:
            if self.function.__doc__ and not group.tooltip:
                group.tooltip = inspect.cleandoc(self.function.__doc__)
            returned = self.function(*args, **kwargs)
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
