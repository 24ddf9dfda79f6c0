"""Task groups: TaskGroup and @task_group."""

from __future__ import annotations

from typing import Any

import pytest

from deferral import DAG, TaskGroup, task, task_group
from deferral.exceptions import DagDefinitionError
from deferral.operators import EmptyOperator
from deferral.utils.task_group import TaskGroup as TaskGroupFromUtils


def upstream(d: DAG, task_id: str) -> set[str]:
    return d.task_dict[task_id].upstream_task_ids


def test_both_import_paths_give_the_same_class() -> None:
    assert TaskGroup is TaskGroupFromUtils


def test_group_id_prefixes_task_ids_and_groups_nest() -> None:
    with DAG("g") as d:
        with TaskGroup("outer") as outer:
            EmptyOperator(task_id="a")
            with TaskGroup("inner") as inner:
                EmptyOperator(task_id="b")
        EmptyOperator(task_id="top")
    assert sorted(d.task_dict) == ["outer.a", "outer.inner.b", "top"]
    assert inner.group_id == "outer.inner"
    assert inner.parent_group is outer
    assert d.task_group_dict == {"outer": outer, "outer.inner": inner}
    assert d.task_dict["outer.a"].task_group is outer
    assert d.task_dict["top"].task_group is None
    assert [t.task_id for t in outer] == ["outer.a", "outer.inner.b"]


def test_prefix_group_id_false_keeps_the_childrens_ids() -> None:
    with DAG("g") as d:
        with TaskGroup("plain", prefix_group_id=False):
            EmptyOperator(task_id="a")
            with TaskGroup("inner") as inner:
                EmptyOperator(task_id="b")
        with TaskGroup("outer"), TaskGroup("unprefixed", prefix_group_id=False) as unprefixed:
            EmptyOperator(task_id="c")
    assert sorted(d.task_dict) == ["a", "c", "inner.b"]
    assert inner.group_id == "inner"
    assert unprefixed.group_id == "outer.unprefixed"


def test_group_to_group_wires_leaves_to_roots() -> None:
    with DAG("g") as d:
        with TaskGroup("first") as first:
            a = EmptyOperator(task_id="a")
            b = EmptyOperator(task_id="b")
            c = EmptyOperator(task_id="c")
            a >> [b, c]
        with TaskGroup("second") as second:
            x = EmptyOperator(task_id="x")
            y = EmptyOperator(task_id="y")
            x >> y
            EmptyOperator(task_id="z")
        returned = first >> second
    assert returned is second
    assert [t.task_id for t in first.roots] == ["first.a"]
    assert [t.task_id for t in first.leaves] == ["first.b", "first.c"]
    assert upstream(d, "second.x") == {"first.b", "first.c"}
    assert upstream(d, "second.z") == {"first.b", "first.c"}
    assert upstream(d, "second.y") == {"second.x"}
    del a, b, c, y


def test_group_and_task_in_both_directions_and_lists() -> None:
    with DAG("g") as d:
        start = EmptyOperator(task_id="start")
        with TaskGroup("grp") as grp:
            EmptyOperator(task_id="only")
        end = EmptyOperator(task_id="end")
        other = EmptyOperator(task_id="other")
        start >> grp >> end
        grp << other
        [EmptyOperator(task_id="l")] >> grp
    assert upstream(d, "grp.only") == {"start", "other", "l"}
    assert upstream(d, "end") == {"grp.only"}
    del end


def test_default_args_of_a_group_apply_over_the_dags_and_nest() -> None:
    with DAG("g", default_args={"retries": 1, "queue": "q_dag"}) as d:
        with TaskGroup("outer", default_args={"retries": 2}):
            EmptyOperator(task_id="a")
            EmptyOperator(task_id="explicit", retries=7)
            with TaskGroup("inner", default_args={"queue": "q_inner"}):
                EmptyOperator(task_id="b")
        EmptyOperator(task_id="c")
    got = {tid: (t.retries, t.queue) for tid, t in d.task_dict.items()}
    assert got == {
        "outer.a": (2, "q_dag"),
        "outer.explicit": (7, "q_dag"),
        "outer.inner.b": (2, "q_inner"),
        "c": (1, "q_dag"),
    }


def test_explicit_dag_and_parent_group_arguments() -> None:
    d = DAG("g")
    outer = TaskGroup("outer", dag=d)
    inner = TaskGroup("inner", parent_group=outer)
    op = EmptyOperator(task_id="t", task_group=inner)
    assert op.dag is d and op.task_id == "outer.inner.t"


@pytest.mark.parametrize("bad", ["with.dot", "", "sp ace", 5])
def test_invalid_group_id_is_refused_naming_it(bad: Any) -> None:
    with DAG("g"), pytest.raises(DagDefinitionError, match=f"group_id {bad!r} is invalid"):
        TaskGroup(bad)


def test_group_outside_a_dag_is_refused() -> None:
    with pytest.raises(DagDefinitionError, match="task group 'g' is outside a DAG"):
        TaskGroup("g")


def test_duplicate_group_and_clashes_with_task_ids_are_refused() -> None:
    with DAG("g"):
        TaskGroup("grp")
        with pytest.raises(DagDefinitionError, match="two task groups with id 'grp'"):
            TaskGroup("grp")
        EmptyOperator(task_id="taken")
        with pytest.raises(DagDefinitionError, match="task group id 'taken' is already a task's"):
            TaskGroup("taken")
        with pytest.raises(DagDefinitionError, match="task id 'grp' is already a task group's id"):
            EmptyOperator(task_id="grp")


def test_dependency_on_an_empty_group_is_refused_naming_it() -> None:
    with DAG("g"):
        empty = TaskGroup("empty")
        op = EmptyOperator(task_id="t")
        with pytest.raises(DagDefinitionError, match="task group 'empty' has no tasks yet"):
            op >> empty


def test_bad_default_args_of_a_group_is_refused() -> None:
    with DAG("g"), pytest.raises(DagDefinitionError, match="task group 'g': default_args must"):
        TaskGroup("g", default_args=["retries"])  # type: ignore[arg-type]


def test_group_of_another_dag_is_refused_for_a_task() -> None:
    other = DAG("other")
    grp = TaskGroup("grp", dag=other)
    with DAG("g"), pytest.raises(DagDefinitionError, match="task 't' and its task group 'grp'"):
        EmptyOperator(task_id="t", dag=DAG.current(), task_group=grp)


# -- @task_group ---------------------------------------------------------------------------------


def test_task_group_decorator_builds_a_group_per_call_and_forwards_the_return_value() -> None:
    @task
    def extract() -> int:
        return 1

    @task
    def load(x: int) -> None:
        return None

    @task_group
    def etl(value: int) -> Any:
        """Extract then load."""
        return load(value)

    with DAG("g") as d:
        start = EmptyOperator(task_id="start")
        first = etl(extract())
        second = etl.override(group_id="custom")(2)
        third = etl(3)
        start >> first
    assert sorted(d.task_group_dict) == ["custom", "etl", "etl__1"]
    assert d.task_group_dict["etl"].tooltip == "Extract then load."
    assert first.operator.task_id == "etl.load"
    assert upstream(d, "etl.load") == {"extract", "start"}
    assert second.operator.task_id == "custom.load"
    assert third.operator.task_id == "etl__1.load"


def test_task_group_decorator_returns_the_group_when_the_function_returns_none() -> None:
    @task_group(group_id="grp", default_args={"retries": 4}, prefix_group_id=True)
    def builds() -> None:
        EmptyOperator(task_id="a") >> EmptyOperator(task_id="b")

    with DAG("g") as d:
        start = EmptyOperator(task_id="start")
        grp = builds()
        start >> grp
    assert isinstance(grp, TaskGroup)
    assert upstream(d, "grp.a") == {"start"}
    assert d.task_dict["grp.b"].retries == 4


def test_task_group_decorator_given_a_non_function_is_refused() -> None:
    with pytest.raises(DagDefinitionError, match="@task_group takes a function"):
        task_group("name")
