"""TaskFlow: @dag, @task and its variants, XComArg, mixing with classic operators."""

from __future__ import annotations

import copy
import datetime as dt
from collections.abc import Mapping
from typing import Any

import pytest

import deferral.decorators
from deferral import DAG, TaskGroup, XComArg, chain, dag, task
from deferral.authoring.templating import (
    TemplateRenderError,
    render_template,
    render_template_fields,
)
from deferral.context import Context, DagRunInfo, RuntimeTaskInstance
from deferral.decorators.python import DecoratedPythonOperator
from deferral.exceptions import DagDefinitionError
from deferral.operators import EmptyOperator, PythonOperator
from deferral.operators.bash import BashOperator
from deferral.sensors import PokeReturnValue
from deferral.xcom_arg import DagParam, find_runtime_args
from worker.attempt import push_outputs

LOGICAL = dt.datetime(2024, 5, 1, tzinfo=dt.UTC)


class MemoryXComs:
    """XComs in a dict: (task_id, key) -> value; pushes by task instance id 7 land on
    ``pushing_task``."""

    def __init__(self, values: dict[tuple[str, str], Any] | None = None) -> None:
        self.values = dict(values or {})
        self.pushing_task = ""

    def push(self, task_instance_id: int, key: str, value: Any) -> None:
        self.values[(self.pushing_task, key)] = value

    def pull(self, dag_id: str, run_id: str, task_id: str, key: str, map_index: int | None) -> Any:
        return self.values.get((task_id, key))


def context_for(op: Any, xcoms: MemoryXComs, conf: dict[str, Any] | None = None) -> Context:
    xcoms.pushing_task = op.task_id
    ti = RuntimeTaskInstance(
        id=7,
        dag_id=op.dag.dag_id,
        run_id="run1",
        task_id=op.task_id,
        map_index=-1,
        try_number=1,
        xcoms=xcoms,
        first_started_at=dt.datetime.now(dt.UTC),
    )
    conf = conf or {}
    return {
        "ti": ti,
        "task": op,
        "dag": op.dag,
        "dag_run": DagRunInfo(op.dag.dag_id, "run1", LOGICAL, conf),
        "run_id": "run1",
        "logical_date": LOGICAL,
        "params": {**op.dag.params, **conf},
        "try_number": 1,
    }


def run(op: Any, xcoms: MemoryXComs, conf: dict[str, Any] | None = None) -> Any:
    """Run a task as the worker does: a deep copy, template fields rendered (XComArgs pulled),
    then execute (and a dict result's keys pushed, with multiple_outputs)."""
    fresh = copy.deepcopy(op)
    context = context_for(fresh, xcoms, conf)
    render_template_fields(fresh, context)
    value = fresh.execute(context)
    push_outputs(fresh, value, context["ti"])
    xcoms.values[(fresh.task_id, "return_value")] = value
    return value


# -- @task -------------------------------------------------------------------------------------


def test_both_import_paths_give_the_same_decorators() -> None:
    assert deferral.decorators.task is task
    assert deferral.decorators.dag is dag


def test_task_call_returns_an_xcomarg_of_a_python_operator_named_after_the_function() -> None:
    @task
    def extract() -> int:
        return 1

    with DAG("tf"):
        result = extract()
    assert isinstance(result, XComArg)
    assert result.key == "return_value"
    assert isinstance(result.operator, DecoratedPythonOperator)
    assert isinstance(result.operator, PythonOperator)
    assert result.operator.task_id == "extract"
    assert extract.function() == 1  # the plain function stays reachable


def test_task_with_parentheses_and_operator_arguments() -> None:
    @task(retries=3, task_id="renamed", queue="fast")
    def f() -> None:
        return None

    with DAG("tf"):
        op = f().operator
    assert (op.task_id, op.retries, op.queue) == ("renamed", 3, "fast")


def test_xcomargs_as_arguments_make_dependencies_and_resolve_at_run_time() -> None:
    @task
    def extract() -> int:
        return 20

    @task
    def add(x: int, y: int) -> int:
        return x + y

    with DAG("tf"):
        a = extract()
        b = extract()
        total = add(a, y=b)
    assert total.operator.upstream_task_ids == {"extract", "extract__1"}
    xcoms = MemoryXComs()
    run(a.operator, xcoms)
    xcoms.values[("extract__1", "return_value")] = 22
    assert run(total.operator, xcoms) == 42


def test_xcomargs_nested_in_containers_resolve_and_keep_container_types() -> None:
    @task
    def one() -> int:
        return 1

    @task
    def show(values: Any) -> Any:
        return values

    with DAG("tf"):
        x = one()
        shown = show({"list": [x, 2], "tuple": (x,), "set": {3}, "plain": "s"})
    assert shown.operator.upstream_task_ids == {"one"}
    xcoms = MemoryXComs({("one", "return_value"): 1})
    assert run(shown.operator, xcoms) == {"list": [1, 2], "tuple": (1,), "set": {3}, "plain": "s"}
    # The DAG's operator keeps its XComArg: resolution happens on the worker's copy.
    assert isinstance(shown.operator.op_args[0]["list"][0], XComArg)


def test_calling_the_same_task_twice_gives_numbered_ids_as_airflow() -> None:
    @task
    def step() -> None:
        return None

    with DAG("tf") as d:
        for _ in range(3):
            step()
        step.override(task_id="other")()
        step.override(task_id="other")()
    assert sorted(d.task_dict) == ["other", "other__1", "step", "step__1", "step__2"]


def test_override_keeps_the_original_decorator_unchanged() -> None:
    @task(retries=1)
    def f() -> None:
        return None

    with DAG("tf"):
        first = f.override(retries=5, pool="p")().operator
        second = f().operator
    assert (first.retries, first.pool) == (5, "p")
    assert (second.retries, second.pool) == (1, "default_pool")


def test_multiple_outputs_pushes_each_key_and_returns_the_dict() -> None:
    @task(multiple_outputs=True)
    def pair() -> Any:
        return {"left": 1, "right": [2]}

    @task
    def use(left: int, right: list[int]) -> int:
        return left + right[0]

    with DAG("tf"):
        p = pair()
        total = use(p["left"], p["right"])
    assert total.operator.upstream_task_ids == {"pair"}
    xcoms = MemoryXComs()
    assert run(p.operator, xcoms) == {"left": 1, "right": [2]}
    assert xcoms.values[("pair", "left")] == 1
    assert xcoms.values[("pair", "right")] == [2]
    assert run(total.operator, xcoms) == 3


def test_multiple_outputs_is_inferred_from_a_mapping_return_annotation() -> None:
    @task
    def as_dict() -> dict[str, int]:
        return {}

    @task
    def as_mapping() -> Mapping[str, int]:
        return {}

    @task
    def as_int() -> int:
        return 0

    @task
    def unannotated():  # type: ignore[no-untyped-def]
        return {}

    @task(multiple_outputs=False)
    def forced_off() -> dict[str, int]:
        return {}

    with DAG("tf"):
        found = {
            f.function.__name__: f().operator.multiple_outputs
            for f in (as_dict, as_mapping, as_int, unannotated, forced_off)
        }
    assert found == {
        "as_dict": True,
        "as_mapping": True,
        "as_int": False,
        "unannotated": False,
        "forced_off": False,
    }


def test_multiple_outputs_with_a_non_dict_result_fails_naming_the_task() -> None:
    @task(multiple_outputs=True)
    def bad() -> Any:
        return [1, 2]

    @task(multiple_outputs=True)
    def bad_keys() -> Any:
        return {1: "x"}

    with DAG("tf"):
        a, b = bad(), bad_keys()
    with pytest.raises(TypeError, match="task 'bad' has multiple_outputs but returned list"):
        run(a.operator, MemoryXComs())
    with pytest.raises(TypeError, match=r"task 'bad_keys' .* must be str, got 1 \(int\)"):
        run(b.operator, MemoryXComs())


def test_multiple_outputs_on_a_classic_operator_as_airflow() -> None:
    """Airflow takes multiple_outputs on any operator: a dict result is pushed key by key; a
    string (a BashOperator's last line) fails the task."""
    with DAG("tf"):
        keyed = PythonOperator(
            task_id="keyed", python_callable=lambda: {"a": 1}, multiple_outputs=True
        )
        line = BashOperator(task_id="line", bash_command="echo hi", multiple_outputs=True)
        quiet = PythonOperator(
            task_id="quiet",
            python_callable=lambda: "x",
            multiple_outputs=True,
            do_xcom_push=False,
        )
    xcoms = MemoryXComs()
    assert run(keyed, xcoms) == {"a": 1}
    assert xcoms.values[("keyed", "a")] == 1
    with pytest.raises(TypeError, match="task 'line' has multiple_outputs but returned str"):
        run(line, xcoms)
    run(quiet, xcoms)  # nothing pushed, nothing checked
    assert ("quiet", "x") not in xcoms.values


def test_multiple_outputs_with_none_pushes_nothing() -> None:
    @task(multiple_outputs=True)
    def nothing() -> Any:
        return None

    with DAG("tf"):
        n = nothing()
    xcoms = MemoryXComs()
    assert run(n.operator, xcoms) is None
    assert set(xcoms.values) == {("nothing", "return_value")}


def test_task_function_receives_context_entries_it_names() -> None:
    @task
    def f(x: int, ti: Any = None, params: Any = None) -> tuple[int, str, Any]:
        return x, ti.task_id, params

    with DAG("tf", params={"p": 1}):
        r = f(5)
    assert run(r.operator, MemoryXComs()) == (5, "f", {"p": 1})


def test_an_argument_given_positionally_is_not_overridden_by_the_context() -> None:
    @task
    def f(params: Any) -> Any:
        return params

    with DAG("tf", params={"p": 1}):
        r = f("mine")
    assert run(r.operator, MemoryXComs()) == "mine"


def test_task_docstring_becomes_doc_md_unless_a_doc_is_given() -> None:
    @task
    def documented() -> None:
        """Loads the thing.

        Second paragraph."""

    with DAG("tf"):
        a = documented().operator
        b = documented.override(doc="plain doc")().operator
    assert a.doc_md == "Loads the thing.\n\nSecond paragraph."
    assert (b.doc, b.doc_md) == ("plain doc", None)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda f: f(1, 2, 3), r"task 'f': too many positional arguments"),
        (lambda f: f(), r"task 'f': missing argument\(s\) 'x' of f\(\)"),
        (lambda f: f(1, nope=2), r"task 'f': got an unexpected keyword argument 'nope'"),
    ],
)
def test_a_call_the_function_cannot_take_is_refused_naming_the_task(
    call: Any, message: str
) -> None:
    @task
    def f(x: int, ti: Any = None) -> int:
        return x

    with DAG("tf"), pytest.raises(DagDefinitionError, match=message):
        call(f)


def test_context_parameter_with_a_non_none_default_is_refused() -> None:
    @task
    def f(params: Any = 5) -> None:
        return None

    with (
        DAG("tf"),
        pytest.raises(
            DagDefinitionError,
            match="task 'f': context parameter 'params' may only default to None",
        ),
    ):
        f()


def test_task_called_outside_a_dag_is_refused() -> None:
    @task
    def lonely() -> None:
        return None

    with pytest.raises(DagDefinitionError, match="@task 'lonely' was called outside a DAG"):
        lonely()


@pytest.mark.parametrize("bad", ["name", 3])
def test_task_given_something_else_than_a_function_is_refused(bad: Any) -> None:
    with pytest.raises(DagDefinitionError, match="@task takes a function and keyword arguments"):
        task(bad)


def test_unknown_operator_argument_of_a_task_is_named_at_call_time() -> None:
    @task(retriez=2)
    def f() -> None:
        return None

    with DAG("tf"), pytest.raises(DagDefinitionError, match=r"'f': unknown argument\(s\) retriez"):
        f()


def test_xcomarg_is_not_iterable_and_keys_must_be_strings() -> None:
    @task
    def f() -> list[int]:
        return [1]

    with DAG("tf"):
        r = f()
    with pytest.raises(TypeError, match="XComArg of task 'f' is not iterable"):
        list(r)
    with pytest.raises(TypeError, match="the XCom key must be a str, got int"):
        r[0]  # type: ignore[index]


def test_operator_output_is_its_xcomarg() -> None:
    with DAG("tf"):
        op = EmptyOperator(task_id="e")
    assert op.output.operator is op and op.output.key == "return_value"


def test_deepcopy_of_a_task_shares_the_tasks_its_xcomargs_name() -> None:
    @task
    def a() -> int:
        return 1

    @task
    def b(x: int) -> int:
        return x

    with DAG("tf"):
        first = a()
        second = b(first)
    clone = copy.deepcopy(second.operator)
    assert clone.op_args[0] is first  # the XComArg, and through it the upstream task, shared


# -- mixing TaskFlow and classic operators ------------------------------------------------------


def test_xcomarg_and_operators_chain_with_shift_both_ways() -> None:
    @task
    def t() -> int:
        return 1

    with DAG("tf"):
        start = EmptyOperator(task_id="start")
        end = EmptyOperator(task_id="end")
        other = EmptyOperator(task_id="other")
        middle = t()
        returned = start >> middle >> end
        assert returned is end
        middle << other
        [EmptyOperator(task_id="l1"), EmptyOperator(task_id="l2")] >> middle
        after = middle >> [EmptyOperator(task_id="r1")]
    op = middle.operator
    assert op.upstream_task_ids == {"start", "other", "l1", "l2"}
    assert op.downstream_task_ids == {"end", "r1"}
    assert isinstance(after, list)


def test_xcomarg_in_classic_operator_arguments_makes_a_dependency_and_resolves() -> None:
    @task
    def number() -> int:
        return 41

    def inc(x: int) -> int:
        return x + 1

    with DAG("tf"):
        n = number()
        classic = PythonOperator(task_id="classic", python_callable=inc, op_kwargs={"x": n})
        positional = PythonOperator(task_id="pos", python_callable=inc, op_args=[n.operator.output])
    assert classic.upstream_task_ids == {"number"}
    assert positional.upstream_task_ids == {"number"}
    xcoms = MemoryXComs({("number", "return_value"): 41})
    assert run(classic, xcoms) == 42
    assert run(positional, xcoms) == 42


def test_chain_accepts_xcomargs_and_groups() -> None:
    @task
    def t() -> None:
        return None

    with DAG("tf"):
        a = t()
        with TaskGroup("g") as g:
            EmptyOperator(task_id="x")
        b = t()
        chain(a, g, [b])
    assert g.children["g.x"].upstream_task_ids == {"t"}  # type: ignore[union-attr]
    assert b.operator.upstream_task_ids == {"g.x"}


def test_xcomarg_across_dags_is_refused() -> None:
    @task
    def t(x: Any = None) -> None:
        return None

    with DAG("one"):
        a = t()
    with DAG("two"), pytest.raises(DagDefinitionError, match="not in the same DAG"):
        t(a)


# -- @task.sensor / branch / short_circuit -----------------------------------------------------


def test_task_sensor_pokes_the_function_and_returns_the_poke_return_value() -> None:
    polls: list[int] = []

    @task.sensor(poke_interval=0.01, timeout=5)
    def ready(limit: int) -> PokeReturnValue:
        polls.append(1)
        return PokeReturnValue(is_done=len(polls) >= limit, xcom_value={"polls": len(polls)})

    @task.sensor(poke_interval=0.01)
    def plain() -> bool:
        return True

    with DAG("tf"):
        r = ready(3)
        p = plain()
    assert r.operator.poke_interval == 0.01
    assert run(r.operator, MemoryXComs()) == {"polls": 3}
    assert run(p.operator, MemoryXComs()) is None


def test_task_sensor_in_reschedule_mode_reschedules_until_done() -> None:
    from deferral.exceptions import RescheduleTask

    @task.sensor(mode="reschedule", poke_interval=30)
    def never() -> bool:
        return False

    with DAG("tf"):
        r = never()
    with pytest.raises(RescheduleTask):
        run(r.operator, MemoryXComs())


def test_task_branch_and_short_circuit_build_their_operators() -> None:
    from deferral.operators import BranchPythonOperator, ShortCircuitOperator

    @task.branch
    def choose() -> str:
        return "a"

    @task.short_circuit(ignore_downstream_trigger_rules=False)
    def gate() -> bool:
        return False

    with DAG("tf"):
        c, g = choose(), gate()
        c >> [EmptyOperator(task_id="a"), EmptyOperator(task_id="b")]
        g >> EmptyOperator(task_id="after_gate")
    assert isinstance(c.operator, BranchPythonOperator)
    assert isinstance(g.operator, ShortCircuitOperator)
    assert g.operator.ignore_downstream_trigger_rules is False
    xcoms = MemoryXComs()
    fresh = copy.deepcopy(c.operator)
    context = context_for(fresh, xcoms)
    assert fresh.execute(context) == "a"
    assert context["ti"].skip_task_ids == {"b"}
    fresh = copy.deepcopy(g.operator)
    context = context_for(fresh, xcoms)
    assert fresh.execute(context) is False
    assert context["ti"].skip_task_ids == {"after_gate"}


# -- @dag ----------------------------------------------------------------------------------------


def test_dag_factory_builds_a_dag_named_after_the_function_with_its_docstring() -> None:
    @dag(schedule=None, default_args={"retries": 2}, params={"given": 1})
    def my_pipeline() -> None:
        """Pipeline docs."""

        @task
        def step() -> None:
            return None

        step()

    built = my_pipeline()
    assert isinstance(built, DAG)
    assert built.dag_id == "my_pipeline"
    assert built.doc_md == "Pipeline docs."
    assert built.task_dict["step"].retries == 2
    assert built.params == {"given": 1}


def test_dag_decorator_without_parentheses_and_with_a_dag_id() -> None:
    @dag
    def bare() -> None:
        EmptyOperator(task_id="e")

    @dag("explicit_id")
    def named() -> None:
        EmptyOperator(task_id="e")

    assert bare().dag_id == "bare"
    assert named().dag_id == "explicit_id"


def test_dag_function_parameters_become_params_resolved_at_run_time() -> None:
    @task
    def show(value: Any) -> Any:
        return value

    @dag
    def with_params(threshold: int = 10, label: str = "x") -> None:
        assert isinstance(threshold, DagParam)
        show(threshold)

    built = with_params(label="y")
    assert built.params == {"threshold": 10, "label": "y"}
    op = built.task_dict["show"]
    assert run(op, MemoryXComs()) == 10
    assert run(op, MemoryXComs(), conf={"threshold": 99}) == 99


def test_dag_factory_called_with_arguments_it_cannot_take_is_refused() -> None:
    @dag
    def needs(x: int) -> None:
        return None

    with pytest.raises(DagDefinitionError, match="DAG 'needs': missing a required argument: 'x'"):
        needs()


def test_runtime_args_are_found_at_any_depth_and_rendering_pulls_them() -> None:
    with DAG("tf"):
        op = EmptyOperator(task_id="e")
    value = {"a": [op.output, (1, op.output["k"])], "b": "plain {{ run_id }}"}
    assert [arg.key for arg in find_runtime_args(value)] == ["return_value", "k"]
    xcoms = MemoryXComs({("e", "return_value"): 1, ("e", "k"): 2})
    rendered = render_template(op, value, context_for(op, xcoms))
    assert rendered == {"a": [1, (1, 2)], "b": "plain run1"}


def test_a_pulled_value_is_not_rendered_as_a_template() -> None:
    @task
    def show(value: Any) -> Any:
        return value

    with DAG("tf"):
        upstream = EmptyOperator(task_id="up")
        shown = show(upstream.output)
    xcoms = MemoryXComs({("up", "return_value"): "{{ run_id }} stays as it is"})
    assert run(shown.operator, xcoms) == "{{ run_id }} stays as it is"


def test_a_runtime_arg_that_cannot_be_resolved_fails_naming_the_field() -> None:
    @task
    def show(value: Any) -> Any:
        return value

    @dag
    def needs_param(missing: Any = None) -> None:
        show(missing)

    built = needs_param()
    op = built.task_dict["show"]
    context = context_for(op, MemoryXComs())
    context["params"] = {}
    with pytest.raises(TemplateRenderError, match=r"op_args\[0\]' of task 'show'.*no param"):
        render_template_fields(copy.deepcopy(op), context)


def test_task_bash_runs_the_command_the_function_returns() -> None:
    @task.bash(env={"WHO": "world"})
    def greet(greeting: str) -> str:
        return f'echo "{greeting} $WHO"'

    @task.bash
    def no_command() -> None:
        return None

    @task
    def word() -> str:
        return "hello"

    with DAG("tf"):
        g = greet(word())
        n = no_command()
    assert g.operator.upstream_task_ids == {"word"}
    assert run(g.operator, MemoryXComs({("word", "return_value"): "hello"})) == "hello world"
    with pytest.raises(TypeError, match=r"@task\.bash task 'no_command' must return the command"):
        run(n.operator, MemoryXComs())
