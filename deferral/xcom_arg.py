"""Values an operator argument holds when the DAG is defined and the worker resolves when the
task runs: ``XComArg`` (what a TaskFlow call returns: an upstream task's XCom) and ``DagParam``
(what a ``@dag`` function's parameters are: the run's params).

They sit in an operator's ``template_fields`` (for TaskFlow tasks: ``op_args``, ``op_kwargs``),
at any depth in lists, tuples, sets and dict values. An XComArg there makes its task upstream
of the operator; the worker replaces each one with its value just before ``execute``.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

from deferral.authoring.dependencies import DependencyMixin

if TYPE_CHECKING:
    from deferral.baseoperator import BaseOperator

RETURN_VALUE_KEY = "return_value"


class RuntimeArg:
    """A placeholder resolved from the task's context at run time."""

    def resolve(self, context: Mapping[str, Any]) -> Any:
        raise NotImplementedError

    def upstream_tasks(self) -> Iterator[BaseOperator]:
        """The tasks whose results the value comes from (they become upstream)."""
        return iter(())

    def __deepcopy__(self, memo: dict[int, Any]) -> RuntimeArg:
        # A reference into the DAG, immutable: copying a task must not copy the tasks it names.
        return self


class XComArg(RuntimeArg, DependencyMixin):
    """The XCom ``key`` of ``operator`` (its return value by default), pulled at run time.

    ``xcom_arg["name"]`` is the XCom ``name`` of the same task (a key of ``multiple_outputs``).
    """

    def __init__(self, operator: BaseOperator, key: str = RETURN_VALUE_KEY) -> None:
        self.operator = operator
        self.key = key

    def __repr__(self) -> str:
        return f"XComArg({self.operator.task_id!r}, key={self.key!r})"

    def __getitem__(self, key: str) -> XComArg:
        if not isinstance(key, str):
            raise TypeError(
                f"XComArg of task {self.operator.task_id!r}: the XCom key must be a str,"
                f" got {type(key).__name__}"
            )
        return XComArg(self.operator, key)

    def __iter__(self) -> Iterator[Any]:
        # Without this, __getitem__ would make ``for x in xcom_arg`` loop forever.
        raise TypeError(
            f"XComArg of task {self.operator.task_id!r} is not iterable at DAG-definition time:"
            " its value exists only when the task runs"
        )

    def upstream_tasks(self) -> Iterator[BaseOperator]:
        yield self.operator

    def as_setup(self) -> XComArg:
        """Mark its task a setup task (``BaseOperator.as_setup``); returns this XComArg."""
        self.operator.as_setup()
        return self

    def as_teardown(
        self, *, setups: Any = None, on_failure_fail_dagrun: bool | None = None
    ) -> XComArg:
        """Mark its task a teardown task (``BaseOperator.as_teardown``); returns this XComArg."""
        self.operator.as_teardown(setups=setups, on_failure_fail_dagrun=on_failure_fail_dagrun)
        return self

    def __enter__(self) -> XComArg:
        self.operator.__enter__()
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        self.operator.__exit__(exc_type, *exc)

    def dependency_tasks(self, *, as_upstream: bool) -> list[BaseOperator]:
        return [self.operator]

    def resolve(self, context: Mapping[str, Any]) -> Any:
        """The value: of every map index of a mapped task (a list), except that a task of a
        mapped task group reading another task of the same group reads its own map index's
        value (Airflow's relevant upstream map index)."""
        ti = context["ti"]
        group = _mapped_group(context.get("task"))
        if ti.map_index >= 0 and group is not None and group is _mapped_group(self.operator):
            return ti.xcom_pull(
                task_ids=self.operator.task_id, key=self.key, map_indexes=ti.map_index
            )
        return ti.xcom_pull(task_ids=self.operator.task_id, key=self.key)


def _mapped_group(task: Any) -> Any:
    """The innermost mapped task group of ``task`` (a TaskGroup), if any."""
    group = getattr(task, "task_group", None)
    return None if group is None else group.innermost_mapped()


class PulledValue(RuntimeArg):
    """A value already pulled from an upstream XCom, standing where an XComArg stood in a
    template field (a mapped task's input for its map index): like the value an XComArg
    resolves to, it is not rendered as a template."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def __repr__(self) -> str:
        return f"PulledValue({self.value!r})"

    def resolve(self, context: Mapping[str, Any]) -> Any:
        return self.value


class DagParam(RuntimeArg):
    """A parameter of a ``@dag`` function: the run's ``params[name]`` (conf overrides it)."""

    def __init__(self, dag_id: str, name: str) -> None:
        self.dag_id = dag_id
        self.name = name

    def __repr__(self) -> str:
        return f"DagParam({self.name!r})"

    def resolve(self, context: Mapping[str, Any]) -> Any:
        params = context["params"]
        if self.name not in params:
            raise KeyError(f"DAG {self.dag_id!r} has no param {self.name!r} and the run gave none")
        return params[self.name]


def find_runtime_args(value: Any) -> Iterator[RuntimeArg]:
    """Every RuntimeArg in ``value``, at any depth of lists, tuples, sets and dict values."""
    if isinstance(value, RuntimeArg):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from find_runtime_args(item)
    elif isinstance(value, list | tuple | set | frozenset):
        for item in value:
            yield from find_runtime_args(item)
