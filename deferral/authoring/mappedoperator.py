"""Dynamic task mapping, as Airflow 2.x: ``Operator.partial(**shared).expand(**mapped)`` (and
``.expand_kwargs(list_of_dicts)``) adds one task to the DAG, a :class:`MappedOperator`, that the
scheduler expands into one task instance per value (map indexes 0..n-1) once the upstream
tasks it maps over have finished (:mod:`deferral.authoring.expandinput` says how many and which
values).

The mapped task is a node of the DAG like any task: its id, dependencies, trigger rule, retries,
pool, queue and callbacks are its ``partial()`` arguments (or the DAG's default_args), which is
all the scheduler needs. What it runs is built for each attempt, in the worker's task process:
:meth:`MappedOperator.unmap` constructs the real operator from the ``partial()`` arguments and
the values of the attempt's map index, as Airflow unmaps a mapped operator.
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, NoReturn

from deferral.authoring.airflow_arguments import TASK_ARGUMENTS
from deferral.authoring.dependencies import relate
from deferral.authoring.expandinput import (
    DictOfListsExpandInput,
    ExpandInput,
    ListOfDictsExpandInput,
    a_type,
    is_mappable_literal,
)
from deferral.authoring.operator import TASK_SETTINGS, BaseOperator
from deferral.dag import DAG
from deferral.exceptions import DagDefinitionError, MappingError
from deferral.runtime.config import max_map_length
from deferral.utils.task_group import TaskGroup
from deferral.xcom_arg import PulledValue, RuntimeArg, XComArg, find_runtime_args

if TYPE_CHECKING:
    from deferral.context import Context


def _keyword_names(function: Callable[..., Any]) -> tuple[set[str], bool]:
    """The names ``function`` takes as keywords, and whether it also takes ``**kwargs``."""
    names, open_ended = set(), False
    for parameter in inspect.signature(function).parameters.values():
        if parameter.kind is parameter.VAR_KEYWORD:
            open_ended = True
        elif parameter.kind in (parameter.POSITIONAL_OR_KEYWORD, parameter.KEYWORD_ONLY):
            names.add(parameter.name)
    names.discard("self")
    return names, open_ended


# The arguments of BaseOperator itself: what the scheduler needs of a task before it expands
# (id, trigger rule, retries, pool, queue ...), so they cannot be mapped.
# Airflow's other task arguments (kept or refused by BaseOperator) count as its own.
BASE_ARGUMENTS = frozenset(
    (_keyword_names(BaseOperator.__init__)[0] - {"_from_mapped"}) | TASK_ARGUMENTS
)


def _own_arguments(operator_class: type[BaseOperator]) -> frozenset[str]:
    """The keyword arguments the classes of ``operator_class`` above BaseOperator take."""
    names: set[str] = set()
    for klass in operator_class.__mro__:
        if klass is BaseOperator:
            break
        init = klass.__dict__.get("__init__")
        if init is not None:
            names |= _keyword_names(init)[0]
    return frozenset(names)


def operator_arguments(operator_class: type[BaseOperator]) -> frozenset[str]:
    """The keyword arguments of ``operator_class`` besides BaseOperator's: what may be mapped."""
    return _own_arguments(operator_class) - BASE_ARGUMENTS


def _check_length(where: str, expand_input: ExpandInput) -> None:
    length, most = expand_input.literal_length(), max_map_length()
    if length is not None and length > most:
        raise DagDefinitionError(
            f"{where} maps over {length} values, more than DEFERRAL_MAX_MAP_LENGTH ({most})"
        )


def check_expand(
    where: str,
    call: str,
    mapped: Mapping[str, Any],
    mappable: frozenset[str] | None,
    shared: Mapping[str, Any],
) -> None:
    """Refuse, naming the task and the argument, an ``expand(**mapped)`` that maps nothing, an
    argument that is not one (``mappable`` None: any name is), a task setting, an argument also
    given to ``partial()``, or a value that is neither a list, a dict nor an XComArg."""
    if not mapped:
        raise DagDefinitionError(f"{where}: {call}() needs at least one argument to map over")
    for name, value in mapped.items():
        _check_name(where, call, name, mappable, shared)
        if not isinstance(value, XComArg) and not is_mappable_literal(value):
            raise DagDefinitionError(
                f"{where}: {call}() maps argument {name!r} over a list, a dict or an XComArg,"
                f" not {a_type(type(value).__name__)}"
            )


def _check_name(
    where: str, call: str, name: object, mappable: frozenset[str] | None, shared: Mapping[str, Any]
) -> None:
    if not isinstance(name, str):
        raise DagDefinitionError(f"{where}: {call}() got a key that is no argument name: {name!r}")
    if name in BASE_ARGUMENTS and (mappable is None or name not in mappable):
        raise DagDefinitionError(
            f"{where}: argument {name!r} cannot be mapped: it is a task setting the scheduler"
            " needs before expanding (give it to partial())"
        )
    if mappable is not None and name not in mappable:
        raise DagDefinitionError(f"{where}: {call}() got an unexpected argument {name!r}")
    if name in shared:
        raise DagDefinitionError(
            f"{where}: argument {name!r} is given to both partial() and {call.split('.')[-1]}()"
        )


def check_expand_kwargs(
    where: str,
    call: str,
    value: Any,
    mappable: frozenset[str] | None,
    shared: Mapping[str, Any],
) -> None:
    """Refuse an ``expand_kwargs(value)`` that is neither an XComArg nor a list of dicts (or
    XComArgs); the keys of literal dicts are checked as ``expand()``'s argument names."""
    if isinstance(value, XComArg):
        return
    if isinstance(value, str | bytes) or not isinstance(value, Sequence):
        kind = a_type(type(value).__name__)
        raise DagDefinitionError(
            f"{where}: {call}() needs a list of dicts or an XComArg, not {kind}"
        )
    for position, item in enumerate(value):
        if isinstance(item, XComArg):
            continue
        if not isinstance(item, Mapping):
            raise DagDefinitionError(
                f"{where}: {call}() needs a list of dicts, item {position} is"
                f" {a_type(type(item).__name__)}"
            )
        for name in item:
            _check_name(where, call, name, mappable, shared)


class OperatorPartial:
    """What ``Operator.partial(**kwargs)`` returns: the arguments every map index shares, until
    ``.expand(...)`` or ``.expand_kwargs(...)`` adds the mapped task to the DAG."""

    def __init__(self, operator_class: type[BaseOperator], kwargs: dict[str, Any]) -> None:
        name = operator_class.__name__
        shared = dict(kwargs)
        label = shared.pop("task_id", None)
        if label is None:
            raise DagDefinitionError(f"{name}.partial() needs a task_id")
        where = f"task {label!r}"
        known = operator_arguments(operator_class) | BASE_ARGUMENTS
        unknown = sorted(set(shared) - known)
        if unknown:
            raise DagDefinitionError(
                f"{where}: {name}.partial() got unexpected argument(s) {', '.join(unknown)}"
            )
        group: TaskGroup | None = shared.pop("task_group", None)
        dag: DAG | None = shared.pop("dag", None) or (group.dag if group else None) or DAG.current()
        self.operator_class = operator_class
        self.label = label
        self.where = where
        self.kwargs = shared
        self.dag = dag
        self.task_group = group if group is not None else TaskGroup.current(dag)

    def __repr__(self) -> str:
        return f"{self.operator_class.__name__}.partial(task_id={self.label!r})"

    def expand(self, **mapped: Any) -> MappedOperator:
        """One task instance per combination of the arguments' values (their cartesian
        product): each a list, a dict (its ``(key, value)`` pairs) or an upstream XComArg."""
        call = f"{self.operator_class.__name__}.expand"
        check_expand(self.where, call, mapped, operator_arguments(self.operator_class), self.kwargs)
        return self._mapped(DictOfListsExpandInput(mapped))

    def expand_kwargs(self, kwargs: Any) -> MappedOperator:
        """One task instance per dict of arguments: a list of dicts (or of XComArgs of dicts),
        or an upstream XComArg holding one."""
        call = f"{self.operator_class.__name__}.expand_kwargs"
        mappable = operator_arguments(self.operator_class)
        check_expand_kwargs(self.where, call, kwargs, mappable, self.kwargs)
        return self._mapped(ListOfDictsExpandInput(kwargs))

    def _mapped(self, expand_input: ExpandInput) -> MappedOperator:
        return MappedOperator(
            operator_class=self.operator_class,
            label=self.label,
            partial_kwargs=self.kwargs,
            expand_input=expand_input,
            mappable=operator_arguments(self.operator_class),
            dag=self.dag,
            task_group=self.task_group,
        )


class MappedOperator(BaseOperator):
    """A task of the DAG that runs once per value of its input (a map index each).

    ``operator_class`` is built, per attempt, from ``partial_kwargs`` and the map index's values
    (:meth:`unmap`); with ``mapped_into`` (TaskFlow: ``"op_kwargs"``) the values go into that
    argument instead of being arguments themselves. ``mappable`` names what may be mapped
    (None: any name)."""

    is_mapped = True
    # The input (a literal list of 10,000 values, say) is only read, never set on: an attempt's
    # copy shares it, and unmap() copies the values of its one map index instead (deep-copying
    # the whole input cost every attempt in proportion to the input: benchmarks/README.md).
    _shallow_attrs = BaseOperator._shallow_attrs | {"expand_input"}

    def __init__(
        self,
        *,
        operator_class: type[BaseOperator],
        label: str,
        partial_kwargs: dict[str, Any],
        expand_input: ExpandInput,
        mappable: frozenset[str] | None,
        mapped_into: str | None = None,
        dag: DAG | None = None,
        task_group: TaskGroup | None = None,
    ) -> None:
        self.operator_class = operator_class
        self.label = label
        self.partial_kwargs = dict(partial_kwargs)
        self.expand_input = expand_input
        self.mappable = mappable
        self.mapped_into = mapped_into
        # An Airflow argument the operator takes itself (TaskFlow's multiple_outputs) is its own.
        own = _own_arguments(operator_class)
        settings = {k: v for k, v in partial_kwargs.items() if k in BASE_ARGUMENTS and k not in own}
        super().__init__(task_id=label, dag=dag, task_group=task_group, **settings)
        _check_length(f"task {self.task_id!r}", expand_input)

    def __repr__(self) -> str:
        return f"<Mapped({self.operator_class.__name__}): {self.task_id}>"

    def _after_init(self) -> None:
        """The tasks whose XComs it maps over, and those of XComArgs in its templated
        ``partial()`` arguments, become upstream."""
        templated = set(self.operator_class.template_fields)
        if self.mapped_into is not None:
            templated.add(self.mapped_into)
        found: list[RuntimeArg] = [*self.expand_input.runtime_args()]
        for name, value in self.partial_kwargs.items():
            if name in templated:
                found += find_runtime_args(value)
        for arg in found:
            for upstream in arg.upstream_tasks():
                relate(upstream, self)

    def mapped_dependencies(self) -> set[str]:
        """The tasks whose XComs it maps over: they must have finished before it expands."""
        return {arg.operator.task_id for arg in self.expand_input.xcom_args()}

    def execute(self, context: Context) -> NoReturn:
        raise MappingError(f"task {self.task_id!r} is mapped: run what unmap() builds instead")

    def unmap(self, context: Context) -> BaseOperator:
        """The operator one map index runs: ``operator_class`` built from the ``partial()``
        arguments and the values of ``context["ti"].map_index`` (pulled now), with this task's
        id, dependencies and settings (as cluster policies left them). Values that came from an
        XCom are not rendered as templates, as in Airflow."""
        where = f"task {self.task_id!r}"
        map_index = context["ti"].map_index
        if map_index < 0:
            raise MappingError(f"{where} is mapped and has not been expanded into map indexes")
        values, pulled = self.expand_input.values(map_index, context, f"{where} [{map_index}]")
        values = copy.deepcopy(values)  # the input is shared by every attempt in this process
        kwargs = copy.deepcopy(self.partial_kwargs)
        templated = set(self.operator_class.template_fields)
        target = kwargs
        if self.mapped_into is not None:
            target = kwargs[self.mapped_into] = dict(kwargs.get(self.mapped_into) or {})
        for name, value in values.items():
            if name in target or (self.mappable is not None and name not in self.mappable):
                raise MappingError(
                    f"{where} [{map_index}]: expand_kwargs() gives argument {name!r}, which is"
                    " already given to partial() or cannot be mapped"
                )
            as_template = self.mapped_into is not None or name in templated
            target[name] = PulledValue(value) if name in pulled and as_template else value
        operator = self.operator_class(
            task_id=self.label,
            dag=self.dag,
            task_group=self.task_group,
            _from_mapped=True,
            **kwargs,
        )
        for name in TASK_SETTINGS:
            setattr(operator, name, getattr(self, name))
        operator.upstream_task_ids = self.upstream_task_ids
        operator.downstream_task_ids = self.downstream_task_ids
        return operator


BaseOperator._partial_of = OperatorPartial
