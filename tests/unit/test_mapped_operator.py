"""Dynamic task mapping as DAG files write it: ``Op.partial(...).expand(...)``,
``.expand_kwargs(...)`` and ``@task.expand``; every bad input refused in one line naming the
task and the argument; and what a map index runs (``MappedOperator.unmap``)."""

from __future__ import annotations

import copy
import datetime as dt
from typing import Any

import pytest

from deferral import DAG, TaskGroup, task
from deferral.authoring.mappedoperator import MappedOperator, operator_arguments
from deferral.authoring.templating import render_template_fields
from deferral.baseoperator import BaseOperator
from deferral.context import Context, DagRunInfo, RuntimeTaskInstance, make_context
from deferral.exceptions import DagDefinitionError, MappingError
from deferral.operators import BashOperator, EmptyOperator, PythonOperator
from deferral.sensors import TimeDeltaSensor
from deferral.xcom_arg import XComArg

NOW = dt.datetime(2024, 3, 1, tzinfo=dt.UTC)


class XComs:
    def __init__(self, values: dict[tuple[str, str], Any] | None = None) -> None:
        self.values = values or {}

    def push(self, task_instance_id: int, key: str, value: Any) -> None: ...

    def pull(self, dag_id: str, run_id: str, task_id: str, key: str, map_index: int | None) -> Any:
        return self.values.get((task_id, key))


def context_of(task: BaseOperator, map_index: int, pushed: dict[Any, Any] | None = None) -> Context:
    assert task.dag is not None
    ti = RuntimeTaskInstance(
        1, task.dag.dag_id, "r", task.task_id, map_index, 1, XComs(pushed), NOW
    )
    return make_context(task, DagRunInfo(task.dag.dag_id, "r", NOW), ti)


def unmapped(task: BaseOperator, map_index: int, pushed: dict[Any, Any] | None = None) -> Any:
    """What the worker runs for one map index: unmapped, then rendered."""
    assert isinstance(task, MappedOperator)
    context = context_of(task, map_index, pushed)
    operator = task.unmap(context)
    context["task"] = operator
    render_template_fields(operator, context)
    return operator


# -- classic operators ---------------------------------------------------------------------------


def test_partial_expand_adds_one_mapped_task_with_the_partial_settings() -> None:
    with DAG("m", default_args={"retries": 3}) as dag:
        up = PythonOperator(task_id="up", python_callable=list)
        mapped = BashOperator.partial(task_id="echo", pool="p", env={"A": "1"}).expand(
            bash_command=up.output, cwd=["/a", "/b"]
        )
    assert dag.task_dict["echo"] is mapped
    assert mapped.is_mapped and not up.is_mapped
    assert (mapped.retries, mapped.pool, mapped.trigger_rule) == (3, "p", "all_success")
    assert mapped.upstream_task_ids == {"up"} and up.downstream_task_ids == {"echo"}
    assert mapped.mapped_dependencies() == {"up"}
    assert repr(mapped) == "<Mapped(BashOperator): echo>"


def test_each_map_index_runs_its_own_values_with_the_shared_ones() -> None:
    with DAG("m"):
        up = PythonOperator(task_id="up", python_callable=list)
        mapped = BashOperator.partial(task_id="echo", env={"A": "1"}).expand(
            bash_command=up.output, cwd=["/a", "/b"]
        )
        mapped >> EmptyOperator(task_id="after")
    pushed = {("up", "return_value"): ["echo x", "echo y"]}
    found = [unmapped(mapped, i, pushed) for i in range(4)]
    assert [(op.bash_command, op.cwd) for op in found] == [
        ("echo x", "/a"),
        ("echo x", "/b"),
        ("echo y", "/a"),
        ("echo y", "/b"),
    ]
    operator = found[3]
    assert type(operator) is BashOperator and operator.task_id == "echo"
    assert operator.env == {"A": "1"}
    assert operator.upstream_task_ids == {"up"} and operator.downstream_task_ids == {"after"}


def test_literal_values_render_as_templates_values_from_xcom_do_not() -> None:
    with DAG("m"):
        up = PythonOperator(task_id="up", python_callable=list)
        literal = BashOperator.partial(task_id="literal").expand(
            bash_command=["echo {{ ti.map_index }} {{ ds }}"]
        )
        pulled = BashOperator.partial(task_id="pulled").expand(bash_command=up.output)
    assert unmapped(literal, 0).bash_command == "echo 0 2024-03-01"
    pushed = {("up", "return_value"): ["echo {{ ds }}"]}
    assert unmapped(pulled, 0, pushed).bash_command == "echo {{ ds }}"


def test_cluster_policy_changes_to_the_mapped_task_reach_every_map_index() -> None:
    with DAG("m"):
        mapped = BashOperator.partial(task_id="echo", retries=1).expand(bash_command=["a"])
    mapped.retries = 7  # what a task_policy may do
    mapped.queue = "special"
    operator = unmapped(mapped, 0)
    assert (operator.retries, operator.queue) == (7, "special")


def test_a_mapped_task_in_a_group_keeps_its_group_id() -> None:
    with DAG("m") as dag, TaskGroup("g", default_args={"retries": 2}):
        mapped = BashOperator.partial(task_id="echo").expand(bash_command=["a"])
    assert mapped.task_id == "g.echo" and "g.echo" in dag.task_dict
    operator = unmapped(mapped, 0)
    assert (operator.task_id, operator.retries) == ("g.echo", 2)
    assert operator.task_group is mapped.task_group


def test_a_mapped_sensor_validates_its_values_when_it_runs() -> None:
    with DAG("m"):
        sensors = TimeDeltaSensor.partial(task_id="wait", poke_interval=1).expand(
            delta=[dt.timedelta(seconds=1)], timeout=[-5]
        )
    with pytest.raises(DagDefinitionError, match="task 'wait': timeout must not be negative"):
        unmapped(sensors, 0)


def test_expand_kwargs_gives_each_map_index_its_dict() -> None:
    with DAG("m"):
        mapped = BashOperator.partial(task_id="b", env={"A": "1"}).expand_kwargs(
            [{"bash_command": "echo 1"}, {"bash_command": "echo 2", "cwd": "/"}]
        )
    assert [(op.bash_command, op.cwd) for op in (unmapped(mapped, 0), unmapped(mapped, 1))] == [
        ("echo 1", None),
        ("echo 2", "/"),
    ]


def test_expand_kwargs_from_xcom_with_a_key_partial_gave_fails_naming_it() -> None:
    with DAG("m"):
        up = PythonOperator(task_id="up", python_callable=list)
        mapped = BashOperator.partial(task_id="b", cwd="/").expand_kwargs(up.output)
    pushed = {("up", "return_value"): [{"bash_command": "echo", "cwd": "/tmp"}]}
    with pytest.raises(MappingError, match=r"task 'b' \[0\]: .* argument 'cwd'"):
        unmapped(mapped, 0, pushed)


def test_a_mapped_task_runs_only_once_expanded() -> None:
    with DAG("m"):
        mapped = BashOperator.partial(task_id="b").expand(bash_command=["a"])
    with pytest.raises(MappingError, match="task 'b' is mapped and has not been expanded"):
        unmapped(mapped, -1)


def test_mappable_arguments_are_the_operator_s_own() -> None:
    assert {"bash_command", "env", "cwd", "append_env"} <= operator_arguments(BashOperator)
    assert "retries" not in operator_arguments(BashOperator)
    assert {"poke_interval", "delta", "mode"} <= operator_arguments(TimeDeltaSensor)


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (
            lambda: BashOperator.partial(bash_command="x"),
            "BashOperator.partial() needs a task_id",
        ),
        (
            lambda: BashOperator.partial(task_id="b", nope=1),
            "task 'b': BashOperator.partial() got unexpected argument(s) nope",
        ),
        (
            lambda: BashOperator.partial(task_id="b").expand(),
            "task 'b': BashOperator.expand() needs at least one argument to map over",
        ),
        (
            lambda: BashOperator.partial(task_id="b").expand(nope=[1]),
            "task 'b': BashOperator.expand() got an unexpected argument 'nope'",
        ),
        (
            lambda: BashOperator.partial(task_id="b").expand(retries=[1, 2]),
            "task 'b': argument 'retries' cannot be mapped: it is a task setting",
        ),
        (
            lambda: BashOperator.partial(task_id="b", env={}).expand(env=[{}]),
            "task 'b': argument 'env' is given to both partial() and expand()",
        ),
        (
            lambda: BashOperator.partial(task_id="b").expand(bash_command="echo"),
            "task 'b': BashOperator.expand() maps argument 'bash_command' over a list, a dict"
            " or an XComArg, not a str",
        ),
        (
            lambda: BashOperator.partial(task_id="b").expand(cwd=3),
            "maps argument 'cwd' over a list, a dict or an XComArg, not an int",
        ),
        (
            lambda: BashOperator.partial(task_id="b").expand_kwargs({"bash_command": "x"}),
            "task 'b': BashOperator.expand_kwargs() needs a list of dicts or an XComArg,"
            " not a dict",
        ),
        (
            lambda: BashOperator.partial(task_id="b").expand_kwargs([{"bash_command": "x"}, 2]),
            "task 'b': BashOperator.expand_kwargs() needs a list of dicts, item 1 is an int",
        ),
        (
            lambda: BashOperator.partial(task_id="b").expand_kwargs([{"queue": "q"}]),
            "task 'b': argument 'queue' cannot be mapped",
        ),
    ],
)
def test_bad_mapping_is_refused_naming_the_task_and_the_argument(build: Any, message: str) -> None:
    with DAG("bad"), pytest.raises(DagDefinitionError) as error:
        build()
    assert message in str(error.value)
    assert "\n" not in str(error.value)


def test_a_literal_input_longer_than_max_map_length_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("DEFERRAL_MAX_MAP_LENGTH", "3")
    with DAG("long"), pytest.raises(DagDefinitionError) as error:
        BashOperator.partial(task_id="b").expand(bash_command=["a", "b"], cwd=["x", "y"])
    assert str(error.value) == (
        "task 'b' maps over 4 values, more than DEFERRAL_MAX_MAP_LENGTH (3)"
    )


def test_xcom_args_in_templated_partial_arguments_are_upstream_too() -> None:
    with DAG("m"):
        up = PythonOperator(task_id="up", python_callable=list)
        other = PythonOperator(task_id="other", python_callable=list)
        mapped = BashOperator.partial(task_id="b", env={"X": other.output}).expand(
            bash_command=up.output
        )
    assert mapped.upstream_task_ids == {"up", "other"}
    assert mapped.mapped_dependencies() == {"up"}


# -- TaskFlow ------------------------------------------------------------------------------------


def test_taskflow_expand_maps_function_arguments() -> None:
    @task
    def numbers() -> list[int]:
        return [1, 2, 3]

    @task
    def add(x: int, y: int) -> int:
        """Adds."""
        return x + y

    @task
    def total(values: list[int]) -> int:
        return sum(values)

    with DAG("tf") as dag:
        added = add.partial(y=10).expand(x=numbers())
        total(added)
        again = add.expand(x=[5], y=[6, 7])
    mapped = dag.task_dict["add"]
    assert isinstance(added, XComArg) and added.operator is mapped
    assert again.operator.task_id == "add__1"
    assert mapped.doc_md == "Adds."
    assert mapped.upstream_task_ids == {"numbers"}
    assert mapped.downstream_task_ids == {"total"}
    operator = unmapped(mapped, 1, {("numbers", "return_value"): [1, 2, 3]})
    assert operator.op_kwargs == {"y": 10, "x": 2}
    assert operator.execute(context_of(operator, 1)) == 12
    assert [unmapped(again.operator, i).execute(context_of(mapped, i)) for i in (0, 1)] == [11, 12]


def test_taskflow_expand_kwargs() -> None:
    @task
    def add(x: int, y: int) -> int:
        return x + y

    with DAG("tf"):
        pairs = add.expand_kwargs([{"x": 1, "y": 2}, {"x": 3, "y": 4}])
        shifted = add.partial(y=100).expand_kwargs([{"x": 1}])
    results = [unmapped(pairs.operator, i) for i in (0, 1)]
    assert [op.execute(context_of(op, 0)) for op in results] == [3, 7]
    only = unmapped(shifted.operator, 0)
    assert only.execute(context_of(only, 0)) == 101


def test_taskflow_values_from_xcom_are_not_rendered() -> None:
    @task
    def show(text: str) -> str:
        return text

    @task
    def texts() -> list[str]:
        return ["{{ ds }}"]

    with DAG("tf"):
        mapped = show.expand(text=texts()).operator
    operator = unmapped(mapped, 0, {("texts", "return_value"): ["{{ ds }}"]})
    assert operator.execute(context_of(operator, 0)) == "{{ ds }}"


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda add: add.expand(z=[1]), "task 'add': add.expand() got an unexpected argument 'z'"),
        (
            lambda add: add.partial(x=1).expand(x=[2]),
            "task 'add': argument 'x' is given to both partial() and expand()",
        ),
        (lambda add: add.expand(x=[1]), "task 'add': missing argument(s) 'y' of add()"),
        (
            lambda add: add.expand(x="abc", y=[1]),
            "add.expand() maps argument 'x' over a list, a dict or an XComArg, not a str",
        ),
        (
            lambda add: add.partial(z=1).expand_kwargs([{"x": 1, "y": 2}]),
            "task 'add': got an unexpected keyword argument 'z'",
        ),
        (
            lambda add: add.expand_kwargs([{"w": 1}]),
            "task 'add': add.expand_kwargs() got an unexpected argument 'w'",
        ),
    ],
)
def test_bad_taskflow_mapping_is_refused_naming_the_task_and_the_argument(
    build: Any, message: str
) -> None:
    @task
    def add(x: int, y: int) -> int:
        return x + y

    with DAG("bad"), pytest.raises(DagDefinitionError) as error:
        build(add)
    assert message in str(error.value)


def test_a_function_taking_kwargs_maps_any_name() -> None:
    @task
    def anything(**kwargs: Any) -> dict[str, Any]:
        return kwargs

    with DAG("tf"):
        mapped = anything.expand(whatever=[1]).operator
    assert unmapped(mapped, 0).op_kwargs == {"whatever": 1}


def test_mapping_outside_a_dag_is_refused() -> None:
    @task
    def one(x: int) -> int:
        return x

    with pytest.raises(DagDefinitionError, match="'one' was called outside a DAG"):
        one.expand(x=[1])


def test_xcom_pull_of_a_mapped_task_gives_its_values_in_map_index_order() -> None:
    class Stored:
        def push(self, task_instance_id: int, key: str, value: Any) -> None: ...

        def pull(
            self, dag_id: str, run_id: str, task_id: str, key: str, map_index: int | None
        ) -> Any:
            values = {"mapped": ["a", "b", "c"], "plain": "p"}[task_id]
            if map_index is None or task_id == "plain":
                return values
            return values[map_index]

    ti = RuntimeTaskInstance(1, "d", "r", "reduce", -1, 1, Stored(), NOW)
    assert ti.xcom_pull(task_ids="mapped") == ["a", "b", "c"]
    assert ti.xcom_pull(task_ids="mapped", map_indexes=1) == "b"
    assert ti.xcom_pull(task_ids="mapped", map_indexes=[2, 0]) == ["c", "a"]
    assert ti.xcom_pull(task_ids=["plain", "mapped"]) == ["p", ["a", "b", "c"]]


def test_an_attempts_copy_shares_the_input_and_its_map_index_gets_values_of_its_own() -> None:
    """An attempt deep-copies its task: the input (maybe 10,000 values) is shared, not copied
    each attempt, and what one map index does to its value never reaches the input."""
    with DAG("m", start_date=NOW):
        mapped = PythonOperator.partial(task_id="p", python_callable=print).expand(
            op_kwargs=[{"file": {"name": f"f{i}"}} for i in range(3)]
        )
    attempt = copy.deepcopy(mapped)
    assert isinstance(attempt, MappedOperator)
    assert attempt.expand_input is mapped.expand_input
    operator = attempt.unmap(context_of(attempt, 1))
    assert isinstance(operator, PythonOperator)
    operator.op_kwargs["file"]["name"] = "changed by the task"
    again = copy.deepcopy(mapped).unmap(context_of(mapped, 1))
    assert isinstance(again, PythonOperator)
    assert again.op_kwargs == {"file": {"name": "f1"}}
