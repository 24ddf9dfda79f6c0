"""deferral.authoring.expandinput: how many task instances a mapped task's input makes, and which
values
each map index gets (pure)."""

from __future__ import annotations

import datetime as dt
from typing import Any

import pytest

from deferral import DAG
from deferral.authoring.expandinput import (
    NOTHING_PUSHED,
    DictOfListsExpandInput,
    ListOfDictsExpandInput,
    Shape,
    is_mappable_literal,
    positions,
)
from deferral.context import DagRunInfo, RuntimeTaskInstance, make_context
from deferral.exceptions import MappingError
from deferral.operators import EmptyOperator
from deferral.xcom_arg import XComArg

NOW = dt.datetime(2024, 1, 1, tzinfo=dt.UTC)


class XComs:
    def __init__(self, values: dict[tuple[str, str], Any]) -> None:
        self.values = values

    def push(self, task_instance_id: int, key: str, value: Any) -> None: ...

    def pull(self, dag_id: str, run_id: str, task_id: str, key: str, map_index: int | None) -> Any:
        return self.values.get((task_id, key))


@pytest.fixture
def up() -> EmptyOperator:
    return EmptyOperator(task_id="up", dag=DAG("inputs"))


def context(op: EmptyOperator, values: dict[tuple[str, str], Any], map_index: int) -> Any:
    ti = RuntimeTaskInstance(1, "inputs", "r", "m", map_index, 1, XComs(values), NOW)
    return make_context(op, DagRunInfo("inputs", "r", NOW), ti)


def test_positions_of_a_cartesian_product_vary_the_last_input_fastest() -> None:
    found = [positions(i, [2, 3]) for i in range(6)]
    assert found == [[0, 0], [0, 1], [0, 2], [1, 0], [1, 1], [1, 2]]
    assert positions(4, [5]) == [4]
    assert positions(6, [2, 2, 2]) == [1, 1, 0]


def test_shape_of_values() -> None:
    assert Shape.of([1, 2]) == Shape("list", 2)
    assert Shape.of((1,)) == Shape("tuple", 1)
    assert Shape.of({"a": 1}) == Shape("dict", 1)
    assert Shape.of("ab") == Shape("str")
    assert Shape.of(None) == NOTHING_PUSHED


@pytest.mark.parametrize("value", [[1], (1, 2), range(3), {"a": 1}, []])
def test_mappable_literals(value: Any) -> None:
    assert is_mappable_literal(value)


@pytest.mark.parametrize("value", ["abc", b"ab", 3, None, {1, 2}])
def test_values_that_are_not_mappable_literals(value: Any) -> None:
    assert not is_mappable_literal(value)


def test_literal_lengths_multiply(up: EmptyOperator) -> None:
    literal = DictOfListsExpandInput({"x": [1, 2], "y": range(3), "z": {"a": 1}})
    assert literal.literal_length() == 6
    assert literal.length({}, "task 'm'") == 6
    assert DictOfListsExpandInput({"x": [], "y": [1]}).literal_length() == 0
    assert DictOfListsExpandInput({"x": XComArg(up)}).literal_length() is None


def test_xcom_lengths_come_from_their_shapes(up: EmptyOperator) -> None:
    mapped = DictOfListsExpandInput({"x": XComArg(up), "y": [1, 2]})
    assert mapped.length({("up", "return_value"): Shape("dict", 4)}, "task 'm'") == 8
    assert mapped.xcom_args()[0].operator is up


@pytest.mark.parametrize(
    ("shape", "why"),
    [
        (Shape("int"), "it is an int, not a list or dict"),
        (Shape("str"), "it is a str, not a list or dict"),
        (Shape("datetime"), "it is a datetime, not a list or dict"),
        (NOTHING_PUSHED, "it is nothing (no value was pushed), not a list or dict"),
    ],
)
def test_an_xcom_that_is_not_a_list_or_dict_cannot_be_mapped(
    up: EmptyOperator, shape: Shape, why: str
) -> None:
    mapped = DictOfListsExpandInput({"x": XComArg(up, "rows")})
    with pytest.raises(MappingError) as error:
        mapped.length({("up", "rows"): shape}, "task 'm'")
    assert str(error.value) == (
        f"task 'm' cannot map argument 'x' over the XCom 'rows' of task 'up': {why}"
    )


def test_values_of_each_map_index(up: EmptyOperator) -> None:
    mapped = DictOfListsExpandInput({"x": XComArg(up), "y": {"k1": "v1", "k2": "v2"}})
    pushed = {("up", "return_value"): [10, 20]}
    found = [mapped.values(i, context(up, pushed, i), "task 'm'") for i in range(4)]
    assert [values for values, _ in found] == [
        {"x": 10, "y": ("k1", "v1")},
        {"x": 10, "y": ("k2", "v2")},
        {"x": 20, "y": ("k1", "v1")},
        {"x": 20, "y": ("k2", "v2")},
    ]
    assert {pulled for _, pulled in found} == {frozenset({"x"})}


def test_a_map_index_beyond_the_input_fails_naming_the_task(up: EmptyOperator) -> None:
    mapped = DictOfListsExpandInput({"x": XComArg(up)})
    with pytest.raises(MappingError, match=r"task 'm': map index 2 is out of range: .* 2 value"):
        mapped.values(2, context(up, {("up", "return_value"): [1, 2]}, 2), "task 'm'")


def test_a_pulled_value_that_is_not_a_list_fails_in_the_worker_too(up: EmptyOperator) -> None:
    mapped = DictOfListsExpandInput({"x": XComArg(up)})
    with pytest.raises(MappingError, match=r"argument 'x' over .* it is an int"):
        mapped.values(0, context(up, {("up", "return_value"): 3}, 0), "task 'm'")


def test_expand_kwargs_over_a_literal_list(up: EmptyOperator) -> None:
    kwargs = ListOfDictsExpandInput([{"a": 1}, XComArg(up), {"b": 2}])
    assert kwargs.literal_length() == 3
    pushed = {("up", "return_value"): {"c": 3}}
    assert kwargs.values(0, context(up, pushed, 0), "t") == ({"a": 1}, frozenset())
    assert kwargs.values(1, context(up, pushed, 1), "t") == ({"c": 3}, frozenset({"c"}))
    assert [a.operator.task_id for a in kwargs.xcom_args()] == ["up"]


def test_expand_kwargs_over_an_xcom(up: EmptyOperator) -> None:
    kwargs = ListOfDictsExpandInput(XComArg(up))
    assert kwargs.literal_length() is None
    assert kwargs.length({("up", "return_value"): Shape("list", 2)}, "t") == 2
    pushed = {("up", "return_value"): [{"a": 1}, {"a": 2}]}
    assert kwargs.values(1, context(up, pushed, 1), "t") == ({"a": 2}, frozenset({"a"}))


@pytest.mark.parametrize(
    ("pushed", "why"),
    [
        ({"a": 1}, "needs a list of dicts, but the XCom 'return_value' of task 'up' is a dict"),
        ([1, 2], "needs a list of dicts, item 0 is an int"),
        ([{1: "a"}], "item 0 has a key that is no argument name: 1"),
    ],
)
def test_expand_kwargs_refuses_what_is_not_a_list_of_dicts(
    up: EmptyOperator, pushed: Any, why: str
) -> None:
    kwargs = ListOfDictsExpandInput(XComArg(up))
    with pytest.raises(MappingError, match=why):
        kwargs.values(0, context(up, {("up", "return_value"): pushed}, 0), "task 'm'")


def test_runtime_args_at_any_depth_are_found(up: EmptyOperator) -> None:
    nested = DictOfListsExpandInput({"x": [[XComArg(up, "k")], 2]})
    assert [(a.operator.task_id, a.key) for a in nested.runtime_args()] == [("up", "k")]
    assert nested.xcom_args() == []  # mapped over a literal list: no mapping dependency
