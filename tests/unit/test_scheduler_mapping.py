"""scheduler.decide over map indexes and scheduler.mapping's expansion decisions (pure)."""

from __future__ import annotations

from typing import Any

import pytest

from deferral import DAG, task
from deferral.authoring.expandinput import NOTHING_PUSHED, Shape
from deferral.authoring.mappedoperator import MappedOperator
from deferral.operators import BashOperator, EmptyOperator, PythonOperator
from deferral.states import DagRunState, TaskState
from deferral.trigger_rules import upstream_states
from scheduler.decide import dag_run_outcome, run_states, waiting_task_decisions
from scheduler.mapping import Expansions, shape_of_stored

T = TaskState
UP = ("up", "return_value")


def mapped_dag(trigger_rule: str = "all_success") -> tuple[DAG, MappedOperator]:
    """up >> m (mapped over up's XCom) >> after; m also after side."""
    with DAG("mapped") as dag:
        up = PythonOperator(task_id="up", python_callable=list)
        side = EmptyOperator(task_id="side")
        mapped = BashOperator.partial(task_id="m", trigger_rule=trigger_rule).expand(
            bash_command=up.output
        )
        side >> mapped >> EmptyOperator(task_id="after")
    return dag, mapped


def states(**by_task: Any) -> dict[str, dict[int, str]]:
    """states(up="success", m={0: "success", 1: "failed"}): a str is map index -1."""
    return {
        task_id: value if isinstance(value, dict) else {-1: value}
        for task_id, value in by_task.items()
    }


def decide_run(dag: DAG, run: dict[str, dict[int, str]], shapes: Any = None) -> Any:
    expansions = Expansions(shapes or {}, max_length=4)
    return waiting_task_decisions(dag, run, expansions.decide), expansions.reasons


# -- trigger rules and outcomes over map indexes --------------------------------------------------


def test_upstream_states_count_every_map_index_but_removed_ones() -> None:
    run = states(a="success", m={0: "success", 1: "failed", 2: "removed"}, gone={0: "removed"})
    assert upstream_states(["a", "m"], run) == ["success", "success", "failed"]
    assert upstream_states(["gone"], run) == ["skipped"]
    assert upstream_states(["not_there"], run) == ["none"]


def test_a_task_after_a_mapped_task_waits_for_every_map_index() -> None:
    dag, _ = mapped_dag()
    running = states(up="success", side="success", m={0: "success", 1: "running"}, after="none")
    assert decide_run(dag, running)[0] == {}
    done = states(up="success", side="success", m={0: "success", 1: "success"}, after="none")
    assert decide_run(dag, done)[0] == {"after": T.SCHEDULED}
    failed = states(up="success", side="success", m={0: "failed", 1: "success"}, after="none")
    assert decide_run(dag, failed)[0] == {"after": T.UPSTREAM_FAILED}


def test_run_outcome_over_map_indexes() -> None:
    dag, _ = mapped_dag()
    base = {"up": "success", "side": "success", "after": "success"}
    unfinished = states(**base, m={0: "success", 1: "up_for_retry"})
    assert dag_run_outcome(dag, unfinished) is None
    removed = states(**base, m={0: "success", 1: "removed"})
    assert dag_run_outcome(dag, removed) is DagRunState.SUCCESS
    with DAG("leaf") as leaf_dag:
        BashOperator.partial(task_id="m").expand(bash_command=["a", "b"])
    leaf_failed = states(m={0: "success", 1: "failed"})
    assert dag_run_outcome(leaf_dag, leaf_failed) is DagRunState.FAILED


def test_run_states_groups_task_instances_by_task_and_map_index() -> None:
    class Row:
        def __init__(self, task_id: str, map_index: int, state: str) -> None:
            self.task_id, self.map_index, self.state = task_id, map_index, state

    rows = [Row("a", -1, "success"), Row("m", 1, "none"), Row("m", 0, "queued")]
    assert run_states(rows) == {"a": {-1: "success"}, "m": {1: "none", 0: "queued"}}


# -- expansion decisions --------------------------------------------------------------------------


def test_a_mapped_task_expands_once_its_rule_is_met_and_what_it_maps_over_finished() -> None:
    dag, _ = mapped_dag()
    run = states(up="success", side="success", m="none", after="none")
    decisions, reasons = decide_run(dag, run, {UP: Shape("list", 3)})
    assert decisions == {"m": T.SCHEDULED}
    assert reasons == {"m": "expanded into 3 task instance(s)"}


def test_a_mapped_task_waits_while_its_rule_waits() -> None:
    dag, _ = mapped_dag()
    run = states(up="success", side="running", m="none", after="none")
    assert decide_run(dag, run, {UP: Shape("list", 3)})[0] == {}


def test_a_mapped_task_waits_for_what_it_maps_over_even_when_its_rule_is_met() -> None:
    dag, _ = mapped_dag(trigger_rule="one_success")
    run = states(up="running", side="success", m="none", after="none")
    assert decide_run(dag, run)[0] == {}


@pytest.mark.parametrize(
    ("up_state", "decision", "reason"),
    [
        ("failed", T.UPSTREAM_FAILED, "a task it maps over failed"),
        ("upstream_failed", T.UPSTREAM_FAILED, "a task it maps over failed"),
        ("skipped", T.SKIPPED, "a task it maps over was skipped"),
    ],
)
def test_what_it_maps_over_failing_or_skipped_decides_whatever_the_rule(
    up_state: str, decision: TaskState, reason: str
) -> None:
    dag, _ = mapped_dag(trigger_rule="all_done")
    run = states(up=up_state, side="running", m="none", after="none")
    decisions, reasons = decide_run(dag, run)
    assert decisions["m"] is decision and reasons["m"] == reason
    # The decision cascades in the same call.
    assert decisions["after"] is (T.SKIPPED if decision is T.SKIPPED else T.UPSTREAM_FAILED)


def test_an_empty_input_skips_the_mapped_task_and_its_downstream_in_one_call() -> None:
    dag, _ = mapped_dag()
    run = states(up="success", side="success", m="none", after="none")
    decisions, reasons = decide_run(dag, run, {UP: Shape("list", 0)})
    assert decisions == {"m": T.SKIPPED, "after": T.SKIPPED}
    assert (
        reasons["m"]
        == "nothing to map over: expand(bash_command=XComArg('up', key='return_value')) is empty"
    )


@pytest.mark.parametrize(
    ("shape", "why"),
    [
        (Shape("int"), "it is an int, not a list or dict"),
        (NOTHING_PUSHED, "it is nothing (no value was pushed)"),
        (
            Shape("list", 5),
            "would expand into 5 task instances, more than DEFERRAL_MAX_MAP_LENGTH (4)",
        ),
    ],
)
def test_an_input_that_cannot_be_expanded_fails_the_mapped_task(shape: Shape, why: str) -> None:
    dag, _ = mapped_dag()
    run = states(up="success", side="success", m="none", after="none")
    decisions, reasons = decide_run(dag, run, {UP: shape})
    assert decisions == {"m": T.FAILED, "after": T.UPSTREAM_FAILED}
    assert reasons["m"].startswith("task 'm'") and why in reasons["m"]


def test_a_rule_that_skips_skips_the_placeholder() -> None:
    dag, _ = mapped_dag()
    run = states(up="success", side="skipped", m="none", after="none")
    assert decide_run(dag, run, {UP: Shape("list", 2)}) == (
        {"m": T.SKIPPED, "after": T.SKIPPED},
        {"m": "trigger rule"},
    )


def test_a_cleared_expanded_task_is_decided_like_its_placeholder() -> None:
    dag, _ = mapped_dag()
    run = states(up="success", side="success", m={0: "none", 1: "none"}, after="none")
    assert decide_run(dag, run, {UP: Shape("list", 1)})[0] == {"m": T.SCHEDULED}


def test_mapping_over_a_mapped_task_waits_for_all_its_map_indexes() -> None:
    with DAG("chain") as dag:
        first = BashOperator.partial(task_id="first").expand(bash_command=["a", "b"])
        BashOperator.partial(task_id="second").expand(bash_command=first.output)
    expansions = Expansions({("first", "return_value"): Shape("list", 2)}, max_length=10)
    running = states(first={0: "success", 1: "running"}, second="none")
    assert waiting_task_decisions(dag, running, expansions.decide) == {}
    done = states(first={0: "success", 1: "failed"}, second="none")
    # A failed map index fails the rule (all_success), not the mapped-dependency check.
    assert waiting_task_decisions(dag, done, expansions.decide) == {"second": T.UPSTREAM_FAILED}


def test_literal_mapping_needs_no_shapes() -> None:
    @task
    def one(x: int) -> int:
        return x

    with DAG("literal") as dag:
        one.expand(x=[1, 2])
    expansions = Expansions({}, max_length=10)
    assert waiting_task_decisions(dag, states(one="none"), expansions.decide) == {
        "one": T.SCHEDULED
    }
    assert expansions.expansion(dag.task_dict["one"]).length == 2  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("row", "shape"),
    [
        (("array", None, 3, None), Shape("list", 3)),
        (("object", None, 2, None), Shape("dict", 2)),
        (("object", "tuple", 4, None), Shape("tuple", 4)),
        (("object", "datetime", None, None), Shape("datetime")),
        (("number", None, None, 5), Shape("int")),
        (("string", None, None, "x"), Shape("str")),
        (("null", None, None, None), NOTHING_PUSHED),
    ],
)
def test_shape_of_a_stored_xcom(row: tuple[Any, ...], shape: Shape) -> None:
    assert shape_of_stored(*row) == shape
