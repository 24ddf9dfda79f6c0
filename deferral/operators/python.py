"""PythonOperator and its relatives that decide what runs next: BranchPythonOperator and
ShortCircuitOperator."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from deferral.baseoperator import BaseOperator
from deferral.context import Context, get_current_context
from deferral.dag import DagDefinitionError
from deferral.operators.branch import branch_skips

__all__ = [
    "BranchPythonOperator",
    "PythonOperator",
    "ShortCircuitOperator",
    "call_with_context",
    "get_current_context",
    "is_venv_installed",
]


class PythonCallableMixin:
    """The arguments of a task that calls ``python_callable`` (PythonOperator, PythonSensor):
    ``op_args``, ``op_kwargs`` and ``templates_dict``, templated; the rendered ``templates_dict``
    reaches the callable as its ``templates_dict`` argument."""

    template_fields: Sequence[str] = ("templates_dict", "op_args", "op_kwargs")
    template_ext: Sequence[str] = ()
    task_id: str

    def __init__(
        self,
        *,
        python_callable: Callable[..., Any],
        op_args: Sequence[Any] | None = None,
        op_kwargs: Mapping[str, Any] | None = None,
        templates_dict: dict[str, Any] | None = None,
        templates_exts: Sequence[str] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        if not callable(python_callable):
            raise DagDefinitionError(f"task {self.task_id!r}: python_callable is not callable")
        if templates_exts is not None:
            # Airflow's name: the endings of values (in templates_dict ...) that name a
            # template file rather than hold a template.
            if isinstance(templates_exts, str) or not all(
                isinstance(ext, str) for ext in templates_exts
            ):
                raise DagDefinitionError(
                    f"task {self.task_id!r}: templates_exts must be a list of str"
                )
            self.template_ext = tuple(templates_exts)
        self.python_callable = python_callable
        self.op_args = list(op_args or [])
        self.op_kwargs = dict(op_kwargs or {})
        self.templates_dict = templates_dict

    def call_python_callable(self, context: Context) -> Any:
        available = {**context, "templates_dict": self.templates_dict}
        return call_with_context(self.python_callable, self.op_args, self.op_kwargs, available)


class PythonOperator(PythonCallableMixin, BaseOperator):
    """Calls ``python_callable(*op_args, **op_kwargs)``, adding the context entries its signature
    names (or all of them if it takes ``**kwargs``)."""

    def execute(self, context: Context) -> Any:
        return self.call_python_callable(context)


def call_with_context(
    function: Callable[..., Any],
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
    context: Mapping[str, Any],
) -> Any:
    """``function(*args, **kwargs)`` plus the context entries its signature names (all of them
    if it takes ``**kwargs``) that no argument already gives."""
    try:
        parameters = inspect.signature(function).parameters
    except (TypeError, ValueError):  # builtins such as print have no signature
        return function(*args, **kwargs)
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        wanted = set(context)
    else:
        wanted = set(parameters) & set(context)
    positional = (
        p.name
        for p in parameters.values()
        if p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    )
    given = set(kwargs) | {name for name, _ in zip(positional, args, strict=False)}
    extra = {k: v for k, v in context.items() if k in wanted and k not in given}
    return function(*args, **kwargs, **extra)


class BranchPythonOperator(PythonOperator):
    """The callable returns the task id (or task group id) to follow, a list of them, or None;
    every task directly downstream that is not followed is skipped, and trigger rules carry the
    skip further (a join after the branch wants ``none_failed_min_one_success``)."""

    def execute(self, context: Context) -> Any:
        chosen = super().execute(context)
        context["ti"].skip_task_ids.update(branch_skips(self, chosen))
        return chosen


class ShortCircuitOperator(PythonOperator):
    """A falsy result skips what follows: with ``ignore_downstream_trigger_rules`` (the default)
    every task downstream, whatever its trigger rule; without, only the tasks directly
    downstream, and their own downstream tasks follow their trigger rules."""

    def __init__(self, *, ignore_downstream_trigger_rules: bool = True, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.ignore_downstream_trigger_rules = ignore_downstream_trigger_rules

    def execute(self, context: Context) -> Any:
        condition = super().execute(context)
        if not condition:
            context["ti"].skip_task_ids.update(self.short_circuit_skips())
        return condition

    def short_circuit_skips(self) -> set[str]:
        if self.ignore_downstream_trigger_rules and self.dag is not None:
            return self.dag.downstream_of(self.task_id)
        return set(self.downstream_task_ids)


def is_venv_installed() -> bool:
    """Whether tasks can run in a virtualenv made for them: never in deferral, which has no
    PythonVirtualenvOperator yet, so DAGs written as Airflow's examples are (``if not
    is_venv_installed(): ...``) leave those tasks out."""
    return False
