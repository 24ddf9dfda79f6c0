"""deferral.dag and deferral.baseoperator: the authoring API."""

from __future__ import annotations

import copy
import datetime as dt
from typing import Any

import pytest

from deferral import DAG, BaseOperator, chain, cross_downstream
from deferral.exceptions import DagDefinitionError, TaskDeferred
from deferral.operators import EmptyOperator, PythonOperator
from deferral.trigger_rules import TriggerRule
from deferral.triggers import DateTimeTrigger, TimeDeltaTrigger


def make(dag: DAG, *task_ids: str) -> list[EmptyOperator]:
    return [EmptyOperator(task_id=t, dag=dag) for t in task_ids]


# -- dependencies ----------------------------------------------------------------------------------


def test_rshift_sets_both_directions_and_returns_right_side() -> None:
    with DAG("d") as dag:
        a, b = make(dag, "a", "b")
        result = a >> b
    assert result is b
    assert a.downstream_task_ids == {"b"}
    assert b.upstream_task_ids == {"a"}
    assert a.upstream_task_ids == set()
    assert b.downstream_task_ids == set()


def test_lshift_sets_upstream() -> None:
    dag = DAG("d")
    a, b = make(dag, "a", "b")
    result = a << b
    assert result is b
    assert a.upstream_task_ids == {"b"}
    assert b.downstream_task_ids == {"a"}


def test_chained_rshift() -> None:
    dag = DAG("d")
    a, b, c = make(dag, "a", "b", "c")
    a >> b >> c
    assert a.downstream_task_ids == {"b"}
    assert b.downstream_task_ids == {"c"}
    assert c.upstream_task_ids == {"b"}


def test_task_rshift_list_and_list_rshift_task() -> None:
    dag = DAG("d")
    a, b, c, d = make(dag, "a", "b", "c", "d")
    result = a >> [b, c] >> d
    assert result is d
    assert a.downstream_task_ids == {"b", "c"}
    assert d.upstream_task_ids == {"b", "c"}
    assert b.downstream_task_ids == {"d"}
    assert c.upstream_task_ids == {"a"}


def test_list_lshift_task_and_task_lshift_list() -> None:
    dag = DAG("d")
    a, b, c = make(dag, "a", "b", "c")
    result = [a, b] << c  # c upstream of a and b
    assert result is c
    assert c.downstream_task_ids == {"a", "b"}
    assert a.upstream_task_ids == {"c"}
    d, e = make(dag, "d", "e")
    d << [e, c]
    assert d.upstream_task_ids == {"c", "e"}
    assert e.downstream_task_ids == {"d"}


def test_repeated_dependency_is_idempotent() -> None:
    dag = DAG("d")
    a, b = make(dag, "a", "b")
    a >> b
    a >> b
    b << a
    assert a.downstream_task_ids == {"b"}
    assert b.upstream_task_ids == {"a"}


def test_dependency_across_dags_is_refused() -> None:
    a = EmptyOperator(task_id="a", dag=DAG("one"))
    b = EmptyOperator(task_id="b", dag=DAG("two"))
    with pytest.raises(DagDefinitionError, match="'a' and 'b' are not in the same DAG"):
        a >> b
    assert a.downstream_task_ids == set()


def test_dependency_on_non_task_is_refused() -> None:
    dag = DAG("d")
    (a,) = make(dag, "a")
    with pytest.raises(DagDefinitionError, match="not a task"):
        a >> ["b"]  # type: ignore[list-item]


def test_chain_with_tasks_and_lists() -> None:
    dag = DAG("d")
    a, b, c, d, e, f = make(dag, "a", "b", "c", "d", "e", "f")
    chain(a, [b, c], [d, e], f)
    assert a.downstream_task_ids == {"b", "c"}
    # Equal-length adjacent lists pair up, they do not cross.
    assert b.downstream_task_ids == {"d"}
    assert c.downstream_task_ids == {"e"}
    assert f.upstream_task_ids == {"d", "e"}


def test_chain_adjacent_lists_of_different_length_refused() -> None:
    dag = DAG("d")
    a, b, c = make(dag, "a", "b", "c")
    with pytest.raises(DagDefinitionError, match="different lengths"):
        chain([a, b], [c])


def test_chain_single_and_empty() -> None:
    dag = DAG("d")
    (a,) = make(dag, "a")
    chain(a)
    chain()
    assert a.downstream_task_ids == set()


def test_cross_downstream() -> None:
    dag = DAG("d")
    a, b, c, d = make(dag, "a", "b", "c", "d")
    cross_downstream([a, b], [c, d])
    assert a.downstream_task_ids == {"c", "d"}
    assert b.downstream_task_ids == {"c", "d"}
    assert c.upstream_task_ids == {"a", "b"}
    assert d.upstream_task_ids == {"a", "b"}


def test_cross_downstream_to_single_task() -> None:
    dag = DAG("d")
    a, b, c = make(dag, "a", "b", "c")
    cross_downstream([a, b], c)
    assert c.upstream_task_ids == {"a", "b"}


# -- arguments -------------------------------------------------------------------------------------


def test_builtin_defaults() -> None:
    task = EmptyOperator(task_id="t", dag=DAG("d"))
    assert task.retries == 0
    assert task.retry_delay == dt.timedelta(minutes=5)
    assert task.execution_timeout is None
    assert task.trigger_rule is TriggerRule.ALL_SUCCESS
    assert task.pool == "default_pool"
    assert task.pool_slots == 1
    assert task.queue == "default"
    assert task.priority_weight == 1


def test_default_args_applied_and_overridden() -> None:
    default_args = {
        "retries": 3,
        "retry_delay": dt.timedelta(seconds=10),
        "queue": "gpu",
        "pool": "p1",
        "priority_weight": 7,
        "execution_timeout": dt.timedelta(minutes=1),
        "trigger_rule": "all_done",
    }
    with DAG("d", default_args=default_args):
        inherits = EmptyOperator(task_id="inherits")
        overrides = EmptyOperator(
            task_id="overrides",
            retries=0,
            queue="cpu",
            execution_timeout=None,
            trigger_rule=TriggerRule.ONE_FAILED,
        )
    assert inherits.retries == 3
    assert inherits.retry_delay == dt.timedelta(seconds=10)
    assert inherits.queue == "gpu"
    assert inherits.pool == "p1"
    assert inherits.priority_weight == 7
    assert inherits.execution_timeout == dt.timedelta(minutes=1)
    assert inherits.trigger_rule is TriggerRule.ALL_DONE
    # Explicit values win, including falsy ones (0, None).
    assert overrides.retries == 0
    assert overrides.queue == "cpu"
    assert overrides.execution_timeout is None
    assert overrides.trigger_rule is TriggerRule.ONE_FAILED
    assert overrides.pool == "p1"


def test_default_args_are_copied_from_the_caller() -> None:
    default_args = {"retries": 2}
    dag = DAG("d", default_args=default_args)
    default_args["retries"] = 9
    assert EmptyOperator(task_id="t", dag=dag).retries == 2


def test_unknown_operator_argument_is_named() -> None:
    with pytest.raises(DagDefinitionError) as info:
        EmptyOperator(task_id="t", dag=DAG("d"), retires=3, colour="red")
    message = str(info.value)
    assert "'t'" in message
    assert "colour" in message
    assert "retires" in message


def test_unknown_argument_of_python_operator_is_named() -> None:
    with pytest.raises(DagDefinitionError, match="op_kwarg"):
        PythonOperator(task_id="t", python_callable=print, op_kwarg={})


def test_unknown_trigger_rule_is_refused() -> None:
    with pytest.raises(DagDefinitionError, match="unknown trigger_rule 'sometimes'"):
        EmptyOperator(task_id="t", trigger_rule="sometimes")


@pytest.mark.parametrize("retries", [-1, "3", 1.5])
def test_bad_retries_refused(retries: Any) -> None:
    with pytest.raises(DagDefinitionError, match="retries"):
        EmptyOperator(task_id="t", retries=retries)


def test_bad_queue_refused() -> None:
    with pytest.raises(DagDefinitionError, match="queue 'has space'"):
        EmptyOperator(task_id="t", queue="has space")


@pytest.mark.parametrize("bad", ["", "has space", "slash/no", "x" * 251, "ünïcode", 5, None])
def test_invalid_task_ids_refused(bad: Any) -> None:
    with pytest.raises(DagDefinitionError, match="task_id"):
        EmptyOperator(task_id=bad)


@pytest.mark.parametrize("bad", ["", "a b", "a:b", "x" * 251])
def test_invalid_dag_ids_refused(bad: str) -> None:
    with pytest.raises(DagDefinitionError, match="dag_id"):
        DAG(bad)


@pytest.mark.parametrize("good", ["a", "A-b_c.d", "0", "x" * 250])
def test_valid_ids_accepted(good: str) -> None:
    assert DAG(good).dag_id == good
    assert EmptyOperator(task_id=good).task_id == good


def test_duplicate_task_id_refused() -> None:
    with DAG("d") as dag:
        EmptyOperator(task_id="same")
        with pytest.raises(DagDefinitionError, match="two tasks with id 'same'"):
            EmptyOperator(task_id="same")
    assert len(dag.tasks) == 1


def test_tasks_attach_to_innermost_dag_context() -> None:
    with DAG("outer") as outer:
        a = EmptyOperator(task_id="a")
        with DAG("inner") as inner:
            b = EmptyOperator(task_id="b")
        c = EmptyOperator(task_id="c")
    d = EmptyOperator(task_id="d")
    assert a.dag is outer and c.dag is outer
    assert b.dag is inner
    assert d.dag is None
    assert set(outer.task_dict) == {"a", "c"}
    assert DAG.current() is None


def test_explicit_dag_argument_wins_over_context() -> None:
    other = DAG("other")
    with DAG("ctx") as ctx:
        t = EmptyOperator(task_id="t", dag=other)
    assert t.dag is other
    assert "t" not in ctx.task_dict


def test_get_task_missing_is_named() -> None:
    with pytest.raises(DagDefinitionError, match="DAG 'd' has no task 'nope'"):
        DAG("d").get_task("nope")


# -- graph -----------------------------------------------------------------------------------------


def test_topological_order_puts_upstream_first() -> None:
    dag = DAG("d")
    a, b, c, d, e = make(dag, "e", "d", "c", "b", "a")  # registered in reverse
    # e -> c, d -> c, c -> a, b -> a
    a >> c
    b >> c
    c >> d
    e >> d
    order = [t.task_id for t in dag.topological_order()]
    assert sorted(order) == ["a", "b", "c", "d", "e"]
    for task in dag.tasks:
        for down in task.downstream_task_ids:
            assert order.index(task.task_id) < order.index(down)


def test_topological_order_is_deterministic() -> None:
    dag = DAG("d")
    make(dag, "z", "m", "a")
    assert [t.task_id for t in dag.topological_order()] == ["a", "m", "z"]


@pytest.mark.parametrize("size", [1, 2, 3])
def test_cycle_is_detected_naming_a_task_on_it(size: int) -> None:
    dag = DAG("d")
    ring = make(dag, *[f"r{i}" for i in range(size)])
    (before,) = make(dag, "before")
    (after,) = make(dag, "zafter")
    before >> ring[0]
    for i, task in enumerate(ring):
        task >> ring[(i + 1) % size]
    ring[0] >> after
    with pytest.raises(DagDefinitionError) as info:
        dag.validate()
    message = str(info.value)
    assert "DAG 'd' has a cycle through" in message
    named = message.rsplit(" ", 1)[-1].strip("'")
    assert named in {t.task_id for t in ring}


def test_cycle_error_names_a_task_on_the_cycle_not_one_downstream_of_it() -> None:
    dag = DAG("d")
    x, y, after = make(dag, "x", "y", "a_after")
    x >> y >> x
    y >> after
    with pytest.raises(DagDefinitionError) as info:
        dag.validate()
    assert str(info.value).endswith(("'x'", "'y'"))


def test_acyclic_dag_validates() -> None:
    dag = DAG("d")
    a, b, c = make(dag, "a", "b", "c")
    a >> [b, c]
    b >> c
    dag.validate()


# -- copies and defer ------------------------------------------------------------------------------


class Stateful(BaseOperator):
    def __init__(self, *, payload: dict[str, Any], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.payload = payload

    def execute(self, context: Any) -> Any:
        return None


def test_deepcopy_gives_fresh_attributes_but_shares_dag_and_relatives() -> None:
    with DAG("d") as dag:
        op = Stateful(task_id="s", payload={"list": [1]})
        down = EmptyOperator(task_id="down")
        op >> down
    fresh = copy.deepcopy(op)
    assert fresh is not op
    assert type(fresh) is Stateful
    assert fresh.dag is dag
    assert fresh.upstream_task_ids is op.upstream_task_ids
    assert fresh.downstream_task_ids is op.downstream_task_ids
    assert fresh.payload == op.payload
    assert fresh.payload is not op.payload
    assert fresh.payload["list"] is not op.payload["list"]
    fresh.payload["list"].append(2)
    fresh.scratch = "set during a run"  # type: ignore[attr-defined]
    assert op.payload == {"list": [1]}
    assert not hasattr(op, "scratch")
    assert dag.get_task("s") is op


class TaggedText(str):
    """A str subclass that can hold state: not shared like a plain str."""


def test_deepcopy_shares_immutable_values_only() -> None:
    tagged = TaggedText("x")
    tagged.seen = []  # type: ignore[attr-defined]
    op = Stateful(task_id="s", payload={}, doc="a plain string")
    op.tagged = tagged  # type: ignore[attr-defined]
    op.pair = (1, [2])  # type: ignore[attr-defined]
    fresh = copy.deepcopy(op)
    assert fresh.task_id is op.task_id and fresh.retry_delay is op.retry_delay
    assert fresh.tagged is not tagged and fresh.tagged.seen is not tagged.seen  # type: ignore[attr-defined]
    assert fresh.pair == (1, [2]) and fresh.pair[1] is not op.pair[1]  # type: ignore[attr-defined]


def test_deepcopy_keeps_settings() -> None:
    op = EmptyOperator(task_id="t", retries=2, retry_delay=dt.timedelta(seconds=3), queue="q")
    fresh = copy.deepcopy(op)
    assert (fresh.task_id, fresh.retries, fresh.retry_delay, fresh.queue) == (
        "t",
        2,
        op.retry_delay,
        "q",
    )


def test_defer_raises_task_deferred_with_its_fields() -> None:
    op = EmptyOperator(task_id="t")
    trigger = TimeDeltaTrigger(dt.timedelta(minutes=1))
    with pytest.raises(TaskDeferred) as info:
        op.defer(
            trigger=trigger,
            method_name="resume",
            kwargs={"n": 1},
            timeout=dt.timedelta(seconds=30),
        )
    deferred = info.value
    assert deferred.trigger is trigger
    assert deferred.method_name == "resume"
    assert deferred.kwargs == {"n": 1}
    assert deferred.timeout == dt.timedelta(seconds=30)
    assert "resume" in str(deferred)


def test_defer_defaults() -> None:
    op = EmptyOperator(task_id="t")
    trigger = DateTimeTrigger(dt.datetime(2030, 1, 1, tzinfo=dt.UTC))
    with pytest.raises(TaskDeferred) as info:
        op.defer(trigger=trigger, method_name="execute")
    assert info.value.kwargs == {}
    assert info.value.timeout is None


def test_defer_from_nested_call_depth() -> None:
    class Deep(BaseOperator):
        def execute(self, context: Any) -> Any:
            return self._helper()

        def _helper(self) -> Any:
            self.defer(
                trigger=DateTimeTrigger(dt.datetime(2030, 1, 1, tzinfo=dt.UTC)),
                method_name="done",
            )

    with pytest.raises(TaskDeferred) as info:
        Deep(task_id="deep").execute({})  # type: ignore[arg-type]
    assert info.value.method_name == "done"


def test_base_execute_not_implemented() -> None:
    with pytest.raises(NotImplementedError, match="BaseOperator"):
        BaseOperator(task_id="t").execute({})  # type: ignore[arg-type]


def test_dag_test_names_the_airflow_arguments_it_does_not_take() -> None:
    dag = DAG("tested", schedule=None)
    with pytest.raises(TypeError, match="does not take conn_file_path, use_executor"):
        dag.test(use_executor=True, conn_file_path="conns.yaml")
