"""Mapped task groups (``@task_group ... .expand / .partial / .expand_kwargs``), pure: how the
group maps its tasks, what map index i of a task reads, and which upstream map indexes the
scheduler counts for it (Airflow's relevant upstream map indexes)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import pytest

from deferral import DAG, TaskGroup, task, task_group
from deferral.authoring.expandinput import GroupMappedInput, MappedArgument, Shape
from deferral.authoring.mappedoperator import MappedOperator
from deferral.exceptions import DagDefinitionError, MappingError
from deferral.operators import EmptyOperator
from deferral.states import TaskState
from deferral.xcom_arg import XComArg
from scheduler.decide import relevant_upstream_states, waiting_decisions
from scheduler.mapping import Expansions

T = TaskState


@task
def add(x: int, y: int) -> int:
    return x + y


@task
def total(values: list[int]) -> int:
    return sum(values)


@task_group
def pair(a: int, b: int, by: int = 0) -> Any:
    return add.override(task_id="scaled")(add(a, b), by)


def two_argument_dag() -> tuple[DAG, TaskGroup]:
    """source >> pair (a from source's XCom, b literal, by shared) >> reduce."""
    with DAG("mapped_groups") as dag:
        source = add.override(task_id="source")(0, 0)
        scaled = pair.partial(by=10).expand(a=source, b=[1, 2])
        total.override(task_id="reduce")(scaled)
    return dag, dag.task_group_dict["pair"]


@dataclass
class FakeTi:
    task_id: str
    map_index: int
    xcoms: dict[tuple[str, int | None], Any] = field(default_factory=dict)

    def xcom_pull(
        self, task_ids: str, key: str = "return_value", map_indexes: int | None = None
    ) -> Any:
        return self.xcoms[(task_ids, map_indexes)]


def context_of(dag: DAG, task_id: str, map_index: int, **xcoms: Any) -> dict[str, Any]:
    pulled = {(name.replace("__", "."), None): value for name, value in xcoms.items()}
    return {"ti": FakeTi(task_id, map_index, pulled), "task": dag.task_dict[task_id]}


def test_every_task_of_a_mapped_group_is_mapped_with_the_group() -> None:
    dag, group = two_argument_dag()
    first, second = dag.task_dict["pair.add"], dag.task_dict["pair.scaled"]
    for mapped in (first, second):
        assert isinstance(mapped, MappedOperator)
        assert isinstance(mapped.expand_input, GroupMappedInput)
        assert mapped.mapped_dependencies() == {"source"}
    assert group.expand_input is not None
    assert repr(first.expand_input) == (
        "mapped task group 'pair': expand(a=XComArg('source', key='return_value'), b=[1, 2])"
    )
    a, b = first.partial_kwargs["op_args"]
    assert isinstance(a, MappedArgument) and (a.name, b.name) == ("a", "b")
    # The group's input makes its tasks upstream of its roots only, as Airflow.
    assert dag.task_dict["pair.add"].upstream_task_ids == {"source"}
    assert dag.task_dict["pair.scaled"].upstream_task_ids == {"pair.add"}
    assert dag.task_dict["reduce"].upstream_task_ids == {"pair.scaled"}


def test_a_mapped_group_is_the_cartesian_product_of_its_arguments() -> None:
    dag, _ = two_argument_dag()
    expand_input = dag.task_dict["pair.add"].expand_input
    assert expand_input.length({("source", "return_value"): Shape("list", 3)}, "t") == 6
    a, b = dag.task_dict["pair.add"].partial_kwargs["op_args"]
    # The last argument varies fastest: map index 3 is a=source[1], b=[1, 2][1].
    context = context_of(dag, "pair.add", 3, source=[5, 6, 7])
    assert (a.resolve(context), b.resolve(context)) == (6, 2)
    assert expand_input.values(3, context, "t") == ({}, frozenset())
    with pytest.raises(MappingError, match="map index 6 is out of range"):
        expand_input.values(6, context_of(dag, "pair.add", 6, source=[5, 6, 7]), "t")


def test_a_task_of_the_group_reads_another_of_its_tasks_at_its_own_map_index() -> None:
    dag, _ = two_argument_dag()
    (inner, _by) = dag.task_dict["pair.scaled"].partial_kwargs["op_args"]
    assert isinstance(inner, XComArg)
    context = context_of(dag, "pair.scaled", 1)
    context["ti"].xcoms[("pair.add", 1)] = 42
    assert inner.resolve(context) == 42
    # Outside the group: every map index's value, in map-index order.
    (outer,) = dag.task_dict["reduce"].op_args
    reduce_context = context_of(dag, "reduce", -1, pair__scaled=[1, 2, 3])
    assert outer.resolve(reduce_context) == [1, 2, 3]


def test_expand_kwargs_gives_each_map_index_one_dict() -> None:
    with DAG("mapped_groups") as dag:
        pair.expand_kwargs([{"a": 1, "b": 2, "by": 0}, {"a": 3, "b": 4, "by": 5}])
    a, b = dag.task_dict["pair.add"].partial_kwargs["op_args"]
    _, by = dag.task_dict["pair.scaled"].partial_kwargs["op_args"]
    assert dag.task_dict["pair.add"].expand_input.literal_length() == 2
    first = context_of(dag, "pair.scaled", 0)
    second = context_of(dag, "pair.scaled", 1)
    assert [(a.resolve(c), b.resolve(c), by.resolve(c)) for c in (first, second)] == [
        (1, 2, 0),
        (3, 4, 5),
    ]


def test_expand_kwargs_missing_an_argument_without_default_fails_naming_it() -> None:
    with DAG("mapped_groups") as dag:
        pair.expand_kwargs([{"a": 1}])
    _, b = dag.task_dict["pair.add"].partial_kwargs["op_args"]
    with pytest.raises(MappingError) as failed:
        b.resolve(context_of(dag, "pair.add", 0))
    assert str(failed.value) == (
        "task 'pair.add' [0]: mapped task group 'pair' gives no argument 'b' at map index 0"
    )


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (
            lambda g: g.expand(a="ab"),
            "task group 'per_file': per_file.expand() maps argument 'a' over a list, a dict or"
            " an XComArg, not a str",
        ),
        (
            lambda g: g.expand(c=[1]),
            "task group 'per_file': per_file.expand() got an unexpected argument 'c'",
        ),
        (
            lambda g: g.partial(a=1).expand(a=[1]),
            "task group 'per_file': argument 'a' is given to both partial() and expand()",
        ),
        (
            lambda g: g.partial(c=1),
            "task group 'per_file': partial() got an unexpected argument 'c'",
        ),
        (
            lambda g: g.expand(a=XComArg(EmptyOperator(task_id="up"), "other")),
            "task group 'per_file': per_file.expand() maps over XCom 'other' of task 'up':"
            " a task group maps over return values only",
        ),
        (
            lambda g: g.expand_kwargs(3),
            "task group 'per_file': per_file.expand_kwargs() needs a list of dicts or an"
            " XComArg, not an int",
        ),
        (
            lambda g: g.expand(a=[1], b=[2]),
            "task 'per_file.t' of mapped task group 'per_file': deferral maps only the @task"
            " calls of a mapped group (not a classic operator, an .expand() of its own or a"
            " nested mapped group)",
        ),
    ],
)
def test_a_mapped_group_deferral_cannot_map_is_refused_naming_it(build: Any, message: str) -> None:
    @task_group
    def per_file(a: Any, b: Any = None) -> None:
        EmptyOperator(task_id="t")

    with DAG("mapped_groups"), pytest.raises(DagDefinitionError) as refused:
        build(per_file)
    assert str(refused.value) == message


def test_expand_kwargs_of_a_function_taking_kwargs_is_refused() -> None:
    @task_group
    def open_ended(**kwargs: Any) -> None:
        add(1, 2)

    with DAG("mapped_groups"), pytest.raises(DagDefinitionError) as refused:
        open_ended.expand_kwargs([{"a": 1}])
    assert str(refused.value) == (
        "task group 'open_ended': open_ended.expand_kwargs() cannot map a function taking"
        " *args or **kwargs"
    )


def test_the_group_returns_what_its_function_returns_or_itself() -> None:
    @task_group
    def nothing(a: int) -> None:
        add(a, 1)

    with DAG("mapped_groups") as dag:
        returned = pair.expand(a=[1], b=[2])
        group = nothing.expand(a=[1])
    assert isinstance(returned, XComArg) and returned.operator.task_id == "pair.scaled"
    assert group is dag.task_group_dict["nothing"]


def test_a_task_expanded_again_inside_a_mapped_group_is_refused() -> None:
    @task_group
    def per_num(num: int) -> None:
        add.partial(x=num).expand(y=[1, 2])

    with DAG("mapped_groups"), pytest.raises(DagDefinitionError, match=r"'per_num\.add' of mapped"):
        per_num.expand(num=[1, 2])


# -- the scheduler's decisions ---------------------------------------------------------------------


def decide(dag: DAG, run: dict[str, dict[int, str]], length: int = 2) -> Any:
    shapes = {("source", "return_value"): Shape("list", length)}
    return waiting_decisions(dag, run, Expansions(shapes, max_length=100).decide)


def indexes(state: str, values: Iterable[int]) -> dict[int, str]:
    return dict.fromkeys(values, state)


def test_a_task_of_the_group_counts_its_group_upstream_at_its_own_map_index() -> None:
    dag, _ = two_argument_dag()
    members = frozenset({"pair.add", "pair.scaled"})
    run = {"source": {-1: "success"}, "pair.add": {0: "success", 1: "failed", 2: "running"}}
    scaled = dag.task_dict["pair.scaled"]
    assert relevant_upstream_states(scaled, members, 0, run) == ["success"]
    assert relevant_upstream_states(scaled, members, 1, run) == ["failed"]
    assert relevant_upstream_states(scaled, members, 3, run) == ["none"]
    unexpanded = {"pair.add": {-1: "upstream_failed"}}
    assert relevant_upstream_states(scaled, members, 0, unexpanded) == ["upstream_failed"]


def test_the_placeholders_expand_once_the_group_input_is_there_and_wait_by_index() -> None:
    dag, _ = two_argument_dag()
    before = {"source": {-1: "running"}, "pair.add": {-1: "none"}, "pair.scaled": {-1: "none"}}
    assert decide(dag, before) == ({}, {})
    after = {**before, "source": {-1: "success"}}
    # Both expand (pair.scaled counts no upstream outside the group), nothing runs yet.
    assert decide(dag, after).tasks == {"pair.add": T.SCHEDULED, "pair.scaled": T.SCHEDULED}
    assert decide(dag, after).indexes == {}


def test_map_index_i_runs_once_its_upstream_i_is_done_and_the_reducer_waits_for_all() -> None:
    dag, _ = two_argument_dag()
    run = {
        "source": {-1: "success"},
        "pair.add": {0: "success", 1: "running", 2: "failed", 3: "none"},
        "pair.scaled": indexes("none", range(4)),
        "reduce": {-1: "none"},
    }
    decided = decide(dag, run, length=2)
    # Index 2 failing fails the reducer at once (all_success), as in Airflow.
    assert decided.tasks == {"reduce": T.UPSTREAM_FAILED}
    assert decided.indexes == {
        ("pair.scaled", 0): T.SCHEDULED,
        ("pair.scaled", 2): T.UPSTREAM_FAILED,
        ("pair.add", 3): T.SCHEDULED,
    }
    done = {**run, "pair.add": indexes("success", range(4)), "pair.scaled": {0: "success"}}
    done["pair.scaled"] |= indexes("none", range(1, 4))
    assert decide(dag, done).indexes == {("pair.scaled", i): T.SCHEDULED for i in range(1, 4)}
    assert decide(dag, done).tasks == {}
    finished = {**done, "pair.scaled": {0: "success", 1: "success", 2: "failed", 3: "success"}}
    assert decide(dag, finished).tasks == {"reduce": T.UPSTREAM_FAILED}
    all_done = {**finished, "pair.scaled": indexes("success", range(4))}
    assert decide(dag, all_done).tasks == {"reduce": T.SCHEDULED}


def test_a_failed_index_cascades_to_its_own_index_downstream_in_the_same_evaluation() -> None:
    dag, _ = two_argument_dag()
    run = {
        "source": {-1: "success"},
        "pair.add": {0: "failed", 1: "success"},
        "pair.scaled": {0: "none", 1: "success"},
        "reduce": {-1: "none"},
    }
    decided = decide(dag, run)
    assert decided.indexes == {("pair.scaled", 0): T.UPSTREAM_FAILED}
    assert decided.tasks == {"reduce": T.UPSTREAM_FAILED}
