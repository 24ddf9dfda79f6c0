"""BranchPythonOperator, BaseBranchOperator and ShortCircuitOperator: which tasks they skip."""

from __future__ import annotations

import datetime as dt
from typing import Any

import pytest

from deferral import DAG, TaskGroup
from deferral.context import Context, DagRunInfo, RuntimeTaskInstance
from deferral.operators import (
    BaseBranchOperator,
    BranchPythonOperator,
    EmptyOperator,
    ShortCircuitOperator,
)
from deferral.operators.branch import branch_skips

LOGICAL = dt.datetime(2024, 5, 1, tzinfo=dt.UTC)


class NoXComs:
    def push(self, task_instance_id: int, key: str, value: Any) -> None:
        raise AssertionError("no XCom expected")

    def pull(self, dag_id: str, run_id: str, task_id: str, key: str, map_index: int | None) -> Any:
        raise AssertionError("no XCom expected")


def execute(op: Any) -> tuple[Any, set[str]]:
    """(return value, task ids the task asks to skip)."""
    ti = RuntimeTaskInstance(7, op.dag.dag_id, "r", op.task_id, -1, 1, NoXComs(), LOGICAL)
    context: Context = {
        "ti": ti,
        "task": op,
        "dag": op.dag,
        "dag_run": DagRunInfo(op.dag.dag_id, "r", LOGICAL),
        "run_id": "r",
        "logical_date": LOGICAL,
        "params": {},
        "try_number": 1,
    }
    return op.execute(context), ti.skip_task_ids


def branch_dag(returns: Any) -> tuple[DAG, BranchPythonOperator]:
    with DAG("b") as d:
        branch = BranchPythonOperator(task_id="branch", python_callable=lambda: returns)
        a, b, c = (EmptyOperator(task_id=t) for t in "abc")
        join = EmptyOperator(task_id="join")
        branch >> [a, b, c] >> join
    return d, branch


@pytest.mark.parametrize(
    ("returns", "skipped"),
    [
        ("a", {"b", "c"}),
        (["a", "c"], {"b"}),
        (("b",), {"a", "c"}),
        (None, {"a", "b", "c"}),
        ([], {"a", "b", "c"}),
    ],
)
def test_branch_skips_every_direct_downstream_task_not_chosen(
    returns: Any, skipped: set[str]
) -> None:
    _, branch = branch_dag(returns)
    assert execute(branch) == (returns, skipped)


def test_a_task_downstream_of_a_chosen_one_is_not_skipped() -> None:
    # branch >> [a, join]; a >> join: choosing a keeps join, as Airflow does.
    with DAG("b"):
        branch = BranchPythonOperator(task_id="branch", python_callable=lambda: "a")
        a = EmptyOperator(task_id="a")
        join = EmptyOperator(task_id="join")
        other = EmptyOperator(task_id="other")
        branch >> [a, join, other]
        a >> join
    assert execute(branch)[1] == {"other"}


def test_a_task_group_id_stands_for_the_groups_roots() -> None:
    with DAG("b"):
        branch = BranchPythonOperator(task_id="branch", python_callable=lambda: "grp")
        with TaskGroup("grp") as grp:
            first = EmptyOperator(task_id="first")
            first >> EmptyOperator(task_id="second")
        with TaskGroup("other_grp") as other_grp:
            EmptyOperator(task_id="x")
        branch >> [grp, other_grp]
    assert execute(branch)[1] == {"other_grp.x"}


@pytest.mark.parametrize(
    ("returns", "message"),
    [
        ("nope", "branch task 'branch' chose 'nope', which is neither a task nor a task group"),
        (["a", 3], "branch task 'branch' returned 3 among its branches: not a task id"),
        (42, "branch task 'branch' returned 42: expected a task id, a task group id"),
        ({"a": 1}, "branch task 'branch' returned {'a': 1}: expected a task id"),
    ],
)
def test_a_bad_branch_choice_fails_the_task_naming_it(returns: Any, message: str) -> None:
    _, branch = branch_dag(returns)
    with pytest.raises((TypeError, ValueError), match=message):
        execute(branch)


def test_base_branch_operator_uses_choose_branch() -> None:
    class Choose(BaseBranchOperator):
        def choose_branch(self, context: Context) -> str:
            return "b"

    with DAG("b"):
        chooser = Choose(task_id="chooser")
        chooser >> [EmptyOperator(task_id="a"), EmptyOperator(task_id="b")]
    assert execute(chooser) == ("b", {"a"})


def test_branch_skips_is_empty_for_a_task_without_downstream() -> None:
    with DAG("b"):
        alone = EmptyOperator(task_id="alone")
    assert branch_skips(alone, None) == set()


# -- ShortCircuitOperator ------------------------------------------------------------------------


def short_circuit_dag(result: Any, ignore: bool) -> ShortCircuitOperator:
    with DAG("s"):
        gate = ShortCircuitOperator(
            task_id="gate", python_callable=lambda: result, ignore_downstream_trigger_rules=ignore
        )
        direct = EmptyOperator(task_id="direct")
        later = EmptyOperator(task_id="later", trigger_rule="all_done")
        gate >> direct >> later
        gate >> EmptyOperator(task_id="direct2")
    return gate


@pytest.mark.parametrize("result", [True, 1, "yes", [0]])
def test_short_circuit_with_a_truthy_result_skips_nothing_and_returns_it(result: Any) -> None:
    assert execute(short_circuit_dag(result, ignore=True)) == (result, set())


@pytest.mark.parametrize("result", [False, 0, "", [], None])
def test_short_circuit_ignoring_trigger_rules_skips_everything_downstream(result: Any) -> None:
    assert execute(short_circuit_dag(result, ignore=True)) == (
        result,
        {"direct", "direct2", "later"},
    )


def test_short_circuit_respecting_trigger_rules_skips_only_direct_downstream() -> None:
    gate = short_circuit_dag(False, ignore=False)
    assert gate.ignore_downstream_trigger_rules is False
    assert execute(gate) == (False, {"direct", "direct2"})


def test_short_circuit_defaults_to_ignoring_downstream_trigger_rules() -> None:
    with DAG("s"):
        gate = ShortCircuitOperator(task_id="gate", python_callable=lambda: False)
    assert gate.ignore_downstream_trigger_rules is True
