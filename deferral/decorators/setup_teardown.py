"""``@setup`` and ``@teardown``: a function (or a ``@task`` variant) whose task is a setup or a
teardown task (``deferral.authoring.setup_teardown``), as Airflow's ``airflow.decorators`` gives
them."""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

from deferral.decorators.base import TaskDecorator
from deferral.decorators.python import task
from deferral.exceptions import DagDefinitionError


def _task_decorator(kind: str, function: Any) -> TaskDecorator:
    """``function`` as a ``@task`` (a plain function), or the ``@task`` variant it already is."""
    if isinstance(function, types.FunctionType):
        made: TaskDecorator = task(function)
        return made
    if isinstance(function, TaskDecorator):
        return function
    raise DagDefinitionError(f"{kind} decorates a function or a @task function, not {function!r}")


def setup(function: Callable[..., Any]) -> TaskDecorator:
    """``@setup``: the function's task is a setup task."""
    decorated = _task_decorator("@setup", function)
    if decorated.is_teardown:
        raise DagDefinitionError(f"@setup: {decorated.name!r} is already a teardown")
    decorated.is_setup = True
    return decorated


def teardown(
    function: Callable[..., Any] | None = None, *, on_failure_fail_dagrun: bool = False
) -> Any:
    """``@teardown`` or ``@teardown(on_failure_fail_dagrun=True)``: the function's task is a
    teardown task (trigger rule ``all_done_setup_success``, not to be set otherwise)."""
    if not isinstance(on_failure_fail_dagrun, bool):
        raise DagDefinitionError("@teardown: on_failure_fail_dagrun must be True or False")

    def decorate(target: Callable[..., Any]) -> TaskDecorator:
        decorated = _task_decorator("@teardown", target)
        if decorated.is_setup:
            raise DagDefinitionError(f"@teardown: {decorated.name!r} is already a setup")
        if "trigger_rule" in decorated.operator_kwargs:
            raise DagDefinitionError(
                f"@teardown: {decorated.name!r} sets trigger_rule, which a teardown task's is"
                " always 'all_done_setup_success'"
            )
        decorated.is_teardown = True
        decorated.on_failure_fail_dagrun = on_failure_fail_dagrun
        return decorated

    return decorate if function is None else decorate(function)
