"""TaskFlow machinery: a decorated function becomes a task each time it is called inside a DAG,
and the call returns an XComArg of that task's result."""

from __future__ import annotations

import functools
import inspect
import typing
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from deferral.authoring.expandinput import (
    DictOfListsExpandInput,
    ExpandInput,
    GroupMappedInput,
    ListOfDictsExpandInput,
)
from deferral.authoring.mappedoperator import MappedOperator, check_expand, check_expand_kwargs
from deferral.baseoperator import BaseOperator
from deferral.context import Context
from deferral.dag import DAG
from deferral.exceptions import DagDefinitionError
from deferral.utils.task_group import TaskGroup
from deferral.xcom_arg import XComArg

# Parameters a task function may name to receive context entries instead of arguments.
CONTEXT_KEYS = frozenset(Context.__required_keys__ | Context.__optional_keys__)

_DOC_ATTRIBUTES = ("doc", "doc_md", "doc_rst", "doc_json", "doc_yaml")


def infer_multiple_outputs(function: Callable[..., Any]) -> bool:
    """True when the function's return annotation is a mapping (``-> dict[str, int]``)."""
    try:
        returned = typing.get_type_hints(function).get("return")
    except Exception:  # an annotation that cannot be evaluated says nothing
        return False
    origin = typing.get_origin(returned) or returned
    return isinstance(origin, type) and issubclass(origin, Mapping)


def check_call_arguments(
    task_id: str,
    function: Callable[..., Any],
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
    *,
    complete: bool = True,
) -> None:
    """Refuse, naming the task, a call whose arguments the function cannot take (or, when
    ``complete``, that misses one); parameters named after context entries are filled in when
    the task runs."""
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError):
        return
    parameters = signature.parameters.values()
    for parameter in parameters:
        if parameter.name in CONTEXT_KEYS and parameter.default not in (None, parameter.empty):
            raise DagDefinitionError(
                f"task {task_id!r}: context parameter {parameter.name!r} may only default to None"
            )
    try:
        bound = signature.bind_partial(*args, **kwargs)
    except TypeError as exc:
        raise DagDefinitionError(f"task {task_id!r}: {exc}") from None
    if not complete:
        return
    missing = [
        p.name
        for p in parameters
        if p.name not in bound.arguments
        and p.name not in CONTEXT_KEYS
        and p.default is p.empty
        and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    ]
    if missing:
        raise DagDefinitionError(
            f"task {task_id!r}: missing argument(s) {', '.join(map(repr, missing))}"
            f" of {getattr(function, '__name__', 'its function')}()"
        )


def mappable_parameters(function: Callable[..., Any]) -> frozenset[str] | None:
    """The parameters of a task function an expansion may give (None: it takes ``**kwargs``,
    so any name)."""
    parameters = inspect.signature(function).parameters.values()
    if any(p.kind is p.VAR_KEYWORD for p in parameters):
        return None
    return frozenset(p.name for p in parameters if p.kind is not p.VAR_POSITIONAL)


class TaskDecorator:
    """A function decorated with ``@task`` (or a variant). Calling it inside a DAG adds a task
    (id: the function's name, ``name__1`` on the second call ...) and returns its XComArg;
    ``.override(task_id=..., retries=...)`` gives a decorator with other operator arguments;
    ``.function`` is the plain function."""

    def __init__(
        self,
        kind: str,
        function: Callable[..., Any],
        operator_class: type[BaseOperator],
        operator_kwargs: dict[str, Any],
    ) -> None:
        self.kind = kind
        self.function = function
        self.operator_class = operator_class
        self.operator_kwargs = operator_kwargs
        # What @setup / @teardown made of it (deferral.decorators.setup_teardown).
        self.is_setup = False
        self.is_teardown = False
        self.on_failure_fail_dagrun = False
        functools.update_wrapper(self, function)

    def __repr__(self) -> str:
        return f"<{self.kind} {getattr(self.function, '__name__', self.function)!r}>"

    def override(self, **kwargs: Any) -> TaskDecorator:
        overridden = TaskDecorator(
            self.kind, self.function, self.operator_class, {**self.operator_kwargs, **kwargs}
        )
        overridden.is_setup, overridden.is_teardown = self.is_setup, self.is_teardown
        overridden.on_failure_fail_dagrun = self.on_failure_fail_dagrun
        return overridden

    @property
    def name(self) -> str:
        return str(getattr(self.function, "__name__", "?"))

    def _placement(self) -> tuple[DAG, TaskGroup | None, Any, dict[str, Any]]:
        """The DAG and group a call adds its task to, the task's label (its id within the
        group, made unique) and the other operator arguments."""
        options = dict(self.operator_kwargs)
        group: TaskGroup | None = options.pop("task_group", None)
        dag: DAG | None = options.pop("dag", None) or (group.dag if group else None)
        dag = dag or DAG.current()
        if dag is None:
            raise DagDefinitionError(
                f"{self.kind} {self.name!r} was called outside a DAG: call it inside"
                " `with DAG(...)` or a @dag function"
            )
        group = group or TaskGroup.current(dag)
        label = options.pop("task_id", self.name)
        if isinstance(label, str):
            label = dag.unique_label(label, group)
        return dag, group, label, options

    def _documented(self, operator: BaseOperator) -> XComArg:
        """The task's XComArg; its docs default to the function's docstring. A @setup or
        @teardown function's task is marked so."""
        doc = self.function.__doc__
        if doc and not any(getattr(operator, name) for name in _DOC_ATTRIBUTES):
            operator.doc_md = inspect.cleandoc(doc)
        if self.is_setup:
            operator.as_setup()
        if self.is_teardown:
            operator.as_teardown(on_failure_fail_dagrun=self.on_failure_fail_dagrun)
        return XComArg(operator)

    def __call__(self, *args: Any, **kwargs: Any) -> XComArg:
        dag, group, label, options = self._placement()
        mapped_group = group.innermost_mapped() if group is not None else None
        if mapped_group is not None:  # a task of a mapped task group: mapped with it
            assert mapped_group.expand_input is not None
            check_call_arguments(label, self.function, args, kwargs)
            expand_input = GroupMappedInput(mapped_group.group_id, mapped_group.expand_input)
            return self.mapped_task(dag, group, label, options, expand_input, args, kwargs)
        operator = self.operator_class(
            task_id=label,
            dag=dag,
            task_group=group,
            python_callable=self.function,
            op_args=args,
            op_kwargs=kwargs,
            **options,
        )
        return self._documented(operator)

    def mapped_task(
        self,
        dag: DAG,
        group: TaskGroup | None,
        label: Any,
        options: dict[str, Any],
        expand_input: ExpandInput,
        op_args: Sequence[Any],
        op_kwargs: dict[str, Any],
    ) -> XComArg:
        """The mapped task of a call: ``expand_input``'s values go into ``op_kwargs``."""
        operator = MappedOperator(
            operator_class=self.operator_class,
            label=label,
            partial_kwargs={
                **options,
                "python_callable": self.function,
                "op_args": tuple(op_args),
                "op_kwargs": dict(op_kwargs),
            },
            expand_input=expand_input,
            mappable=mappable_parameters(self.function),
            mapped_into="op_kwargs",
            dag=dag,
            task_group=group,
        )
        return self._documented(operator)

    def partial(self, **kwargs: Any) -> PartialTaskDecorator:
        """Dynamic task mapping: the function arguments every map index shares; then
        ``.expand(arg=[...])`` or ``.expand_kwargs([{...}, ...])`` maps over the others."""
        return PartialTaskDecorator(self, kwargs)

    def expand(self, **mapped: Any) -> XComArg:
        """A task run once per value (per combination, for several arguments) of the function
        arguments given: each a list, a dict or an upstream XComArg. Returns the XComArg of its
        values, in map-index order."""
        return self.partial().expand(**mapped)

    def expand_kwargs(self, kwargs: Any) -> XComArg:
        """A task run once per dict of function arguments (a list of them, or an XComArg)."""
        return self.partial().expand_kwargs(kwargs)


class PartialTaskDecorator:
    """``@task`` function with the arguments every map index shares (``.partial(...)``)."""

    def __init__(self, decorator: TaskDecorator, kwargs: dict[str, Any]) -> None:
        self.decorator = decorator
        self.kwargs = kwargs

    def expand(self, **mapped: Any) -> XComArg:
        dag, group, label, options = self.decorator._placement()
        where = f"task {label!r}"
        call = f"{self.decorator.name}.expand"
        check_expand(where, call, mapped, mappable_parameters(self.decorator.function), self.kwargs)
        arguments = {**self.kwargs, **dict.fromkeys(mapped)}
        check_call_arguments(label, self.decorator.function, (), arguments)
        expand_input = DictOfListsExpandInput(mapped)
        return self.decorator.mapped_task(dag, group, label, options, expand_input, (), self.kwargs)

    def expand_kwargs(self, kwargs: Any) -> XComArg:
        dag, group, label, options = self.decorator._placement()
        where = f"task {label!r}"
        call = f"{self.decorator.name}.expand_kwargs"
        check_expand_kwargs(
            where, call, kwargs, mappable_parameters(self.decorator.function), self.kwargs
        )
        check_call_arguments(label, self.decorator.function, (), self.kwargs, complete=False)
        expand_input = ListOfDictsExpandInput(kwargs)
        return self.decorator.mapped_task(dag, group, label, options, expand_input, (), self.kwargs)


def task_decorator(
    kind: str,
    operator_class: type[BaseOperator],
    python_callable: Callable[..., Any] | None,
    operator_kwargs: dict[str, Any],
) -> Any:
    """``@kind`` or ``@kind(...)``: a TaskDecorator, or a function that makes one."""

    def decorate(function: Callable[..., Any]) -> TaskDecorator:
        if not callable(function):
            raise DagDefinitionError(f"{kind} decorates a function, not {function!r}")
        kwargs = dict(operator_kwargs)
        if "multiple_outputs" in kwargs and kwargs["multiple_outputs"] is None:
            kwargs["multiple_outputs"] = infer_multiple_outputs(function)
        return TaskDecorator(kind, function, operator_class, kwargs)

    if python_callable is None:
        return decorate
    if not callable(python_callable):
        raise DagDefinitionError(
            f"{kind} takes a function and keyword arguments only, got {python_callable!r}"
            " (the task id is the function's name, or task_id=...)"
        )
    return decorate(python_callable)
