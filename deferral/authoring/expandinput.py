"""What a mapped task maps over, how many task instances that makes, and which values each map
index receives: Airflow 2.x's ``DictOfListsExpandInput`` (``expand(**kwargs)``) and
``ListOfDictsExpandInput`` (``expand_kwargs(...)``).

``expand(x=[1, 2], y=["a", "b", "c"])`` maps over the cartesian product of its arguments, the
last one varying fastest (map index 0 is x=1, y="a"; 1 is x=1, y="b" ... 5 is x=2, y="c"); a
dict maps over its ``(key, value)`` pairs. ``expand_kwargs([{...}, {...}])`` gives map index i
the i-th dict. Each argument is a literal list (or tuple, range) or dict, or an XComArg: the
value a finished upstream task pushed, which must then be a list, tuple or dict (a mapped
upstream task gives the list of the values its map indexes pushed).

The scheduler knows an upstream XCom only by its :class:`Shape` (type and length, read in SQL),
the worker by its value; both check it with the same rules here, so a value the scheduler
expanded over is one the worker can map. Everything here is pure.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from deferral.exceptions import MappingError
from deferral.xcom_arg import RuntimeArg, XComArg, find_runtime_args

# An upstream XCom: (task_id, key).
XComRef = tuple[str, str]

_SEQUENCE_TYPES = ("list", "tuple")
_MAPPABLE_TYPES = (*_SEQUENCE_TYPES, "dict")


@dataclass(frozen=True)
class Shape:
    """An XCom as mapping sees it: the name of its value's type (``list``, ``tuple``, ``dict``,
    ``int`` ...; ``None`` when no value was pushed) and, for a list, tuple or dict, its length."""

    type_name: str
    length: int | None = None

    @classmethod
    def of(cls, value: Any) -> Shape:
        if isinstance(value, list | tuple | dict):
            return cls(type(value).__name__, len(value))
        return cls(type(value).__name__)


NOTHING_PUSHED = Shape("NoneType")


def is_mappable_literal(value: Any) -> bool:
    """A literal ``expand()`` takes: a list, tuple, range (any non-text sequence) or a dict."""
    if isinstance(value, str | bytes | bytearray):
        return False
    return isinstance(value, Sequence | Mapping)


def _literal(value: Any) -> list[Any] | dict[Any, Any]:
    return dict(value) if isinstance(value, Mapping) else list(value)


def _ref(arg: XComArg) -> XComRef:
    return (arg.operator.task_id, arg.key)


def _source(arg: XComArg) -> str:
    return f"XCom {arg.key!r} of task {arg.operator.task_id!r}"


def a_type(type_name: str) -> str:
    """``a list``, ``an int``: a type's name in a message."""
    return f"{'an' if type_name[:1] in 'aeiouAEIOU' else 'a'} {type_name}"


def _describe(shape: Shape) -> str:
    return "nothing (no value was pushed)" if shape == NOTHING_PUSHED else a_type(shape.type_name)


def _item(value: list[Any] | tuple[Any, ...] | dict[Any, Any], position: int) -> Any:
    """The ``position``-th value to map over: an item, or a ``(key, value)`` pair of a dict."""
    if isinstance(value, dict):
        for index, pair in enumerate(value.items()):
            if index == position:
                return pair
        raise IndexError(position)
    return value[position]


def positions(map_index: int, lengths: Sequence[int]) -> list[int]:
    """The position of ``map_index`` in each input of a cartesian product, the last input
    varying fastest (every length at least 1)."""
    found = []
    for length in reversed(lengths):
        found.append(map_index % length)
        map_index //= length
    return found[::-1]


class ExpandInput(ABC):
    """The inputs of one mapped task."""

    @abstractmethod
    def xcom_args(self) -> list[XComArg]:
        """The upstream XComs mapped over: their tasks must finish before the task expands."""

    @abstractmethod
    def literal_length(self) -> int | None:
        """How many task instances the literal input makes (None: it depends on XComs)."""

    @abstractmethod
    def length(self, shapes: Mapping[XComRef, Shape], where: str) -> int:
        """How many task instances the input makes, given the shapes of the upstream XComs
        (missing ones pushed nothing); MappingError naming ``where`` and the argument if an
        XCom cannot be mapped over."""

    @abstractmethod
    def values(
        self, map_index: int, context: Mapping[str, Any], where: str
    ) -> tuple[dict[str, Any], frozenset[str]]:
        """The arguments of map index ``map_index`` (upstream XComs pulled through
        ``context``), and the names of those whose value came from an XCom: as in Airflow,
        those are not rendered as templates."""

    def runtime_args(self) -> Iterator[XComArg]:
        """Every XComArg at any depth of the input: each makes its task upstream."""
        for arg in find_runtime_args(self._raw()):
            if isinstance(arg, XComArg):
                yield arg

    @abstractmethod
    def _raw(self) -> Any: ...

    def _pull(self, context: Mapping[str, Any]) -> dict[XComRef, Any]:
        return {_ref(arg): arg.resolve(context) for arg in self.xcom_args()}


class DictOfListsExpandInput(ExpandInput):
    """``expand(**kwargs)``: the cartesian product of the arguments, the last varying fastest."""

    def __init__(self, value: Mapping[str, Any]) -> None:
        self.value: dict[str, Any] = {
            name: item if isinstance(item, XComArg) else _literal(item)
            for name, item in value.items()
        }

    def __repr__(self) -> str:
        return f"expand({', '.join(f'{k}={v!r}' for k, v in self.value.items())})"

    def _raw(self) -> Any:
        return self.value

    def xcom_args(self) -> list[XComArg]:
        return [item for item in self.value.values() if isinstance(item, XComArg)]

    def literal_length(self) -> int | None:
        if self.xcom_args():
            return None
        return math.prod(len(item) for item in self.value.values())

    def _lengths(self, shapes: Mapping[XComRef, Shape], where: str) -> list[int]:
        lengths = []
        for name, item in self.value.items():
            if not isinstance(item, XComArg):
                lengths.append(len(item))
                continue
            shape = shapes.get(_ref(item), NOTHING_PUSHED)
            if shape.type_name not in _MAPPABLE_TYPES or shape.length is None:
                raise MappingError(
                    f"{where} cannot map argument {name!r} over the {_source(item)}: it is"
                    f" {_describe(shape)}, not a list or dict"
                )
            lengths.append(shape.length)
        return lengths

    def length(self, shapes: Mapping[XComRef, Shape], where: str) -> int:
        return math.prod(self._lengths(shapes, where))

    def values(
        self, map_index: int, context: Mapping[str, Any], where: str
    ) -> tuple[dict[str, Any], frozenset[str]]:
        pulled = self._pull(context)
        lengths = self._lengths({ref: Shape.of(v) for ref, v in pulled.items()}, where)
        _check_index(map_index, math.prod(lengths), where)
        found = {}
        places = zip(self.value.items(), positions(map_index, lengths), strict=True)
        for (name, item), position in places:
            source = pulled[_ref(item)] if isinstance(item, XComArg) else item
            found[name] = _item(source, position)
        return found, frozenset(n for n, item in self.value.items() if isinstance(item, XComArg))


class ListOfDictsExpandInput(ExpandInput):
    """``expand_kwargs(value)``: map index i gets the i-th dict of a list (literal, its items
    dicts or XComArgs of dicts) or of an upstream XCom holding a list of dicts."""

    def __init__(self, value: XComArg | Sequence[Mapping[str, Any] | XComArg]) -> None:
        self.value: XComArg | list[dict[str, Any] | XComArg] = (
            value
            if isinstance(value, XComArg)
            else [item if isinstance(item, XComArg) else dict(item) for item in value]
        )

    def __repr__(self) -> str:
        return f"expand_kwargs({self.value!r})"

    def _raw(self) -> Any:
        return self.value

    def xcom_args(self) -> list[XComArg]:
        if isinstance(self.value, XComArg):
            return [self.value]
        return [item for item in self.value if isinstance(item, XComArg)]

    def literal_length(self) -> int | None:
        return None if isinstance(self.value, XComArg) else len(self.value)

    def length(self, shapes: Mapping[XComRef, Shape], where: str) -> int:
        if not isinstance(self.value, XComArg):
            return len(self.value)
        shape = shapes.get(_ref(self.value), NOTHING_PUSHED)
        if shape.type_name not in _SEQUENCE_TYPES or shape.length is None:
            raise MappingError(
                f"{where}: expand_kwargs() needs a list of dicts, but the {_source(self.value)}"
                f" is {_describe(shape)}"
            )
        return shape.length

    def values(
        self, map_index: int, context: Mapping[str, Any], where: str
    ) -> tuple[dict[str, Any], frozenset[str]]:
        if isinstance(self.value, XComArg):
            items = self.value.resolve(context)
            _check_index(map_index, self.length({_ref(self.value): Shape.of(items)}, where), where)
            kwargs, from_xcom = items[map_index], True
        else:
            _check_index(map_index, len(self.value), where)
            kwargs = self.value[map_index]
            from_xcom = isinstance(kwargs, XComArg)
            if isinstance(kwargs, XComArg):
                kwargs = kwargs.resolve(context)
        if not isinstance(kwargs, dict):
            raise MappingError(
                f"{where}: expand_kwargs() needs a list of dicts, item {map_index} is"
                f" {_describe(Shape.of(kwargs))}"
            )
        for key in kwargs:
            if not isinstance(key, str):
                raise MappingError(
                    f"{where}: expand_kwargs() item {map_index} has a key that is no argument"
                    f" name: {key!r}"
                )
        return dict(kwargs), frozenset(kwargs) if from_xcom else frozenset()


def _check_index(map_index: int, total: int, where: str) -> None:
    if not 0 <= map_index < total:
        raise MappingError(
            f"{where}: map index {map_index} is out of range: its input now gives {total}"
            " value(s) (did an upstream task run again?)"
        )


class MappedArgument(RuntimeArg):
    """Inside ``@task_group ... .expand(...)`` (or ``.expand_kwargs(...)``): the group's
    argument ``name``; a task of the group gets, at map index i, the value the group's input
    gives ``name`` at i."""

    def __init__(self, group_id: str, group_input: ExpandInput, name: str) -> None:
        self.group_id = group_id
        self.group_input = group_input
        self.name = name

    def __repr__(self) -> str:
        return f"MappedArgument({self.group_id!r}, {self.name!r})"

    def resolve(self, context: Mapping[str, Any]) -> Any:
        ti = context["ti"]
        where = f"task {ti.task_id!r} [{ti.map_index}]"
        values, _ = self.group_input.values(ti.map_index, context, where)
        if self.name in values:
            return values[self.name]
        raise MappingError(
            f"{where}: mapped task group {self.group_id!r} gives no argument {self.name!r}"
            f" at map index {ti.map_index}"
        )


class GroupMappedInput(ExpandInput):
    """A task of a mapped task group: one map index per value of the group's input (as many as
    it gives, from the same upstream XComs). Its arguments stay as given: a ``MappedArgument``
    resolves to the group's value at the task instance's map index, and the XComArg of another
    task of the group to that task's value at the same map index (``XComArg.resolve``), so map
    index i of every task of the group is the group's i-th."""

    def __init__(self, group_id: str, group_input: ExpandInput) -> None:
        self.group_id = group_id
        self.group_input = group_input

    def __repr__(self) -> str:
        return f"mapped task group {self.group_id!r}: {self.group_input!r}"

    def _raw(self) -> Any:
        # The group's input makes its tasks upstream of the group's roots only (as Airflow),
        # not of each task: TaskGroupDecorator relates them.
        return ()

    def xcom_args(self) -> list[XComArg]:
        return self.group_input.xcom_args()

    def literal_length(self) -> int | None:
        return self.group_input.literal_length()

    def length(self, shapes: Mapping[XComRef, Shape], where: str) -> int:
        return self.group_input.length(shapes, where)

    def values(
        self, map_index: int, context: Mapping[str, Any], where: str
    ) -> tuple[dict[str, Any], frozenset[str]]:
        _check_index(map_index, self._length_now(context, where), where)
        return {}, frozenset()

    def _length_now(self, context: Mapping[str, Any], where: str) -> int:
        pulled = self.group_input._pull(context)
        return self.length({ref: Shape.of(value) for ref, value in pulled.items()}, where)
