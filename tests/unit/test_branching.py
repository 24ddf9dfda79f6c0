"""BranchPythonOperator, BaseBranchOperator and ShortCircuitOperator: which tasks they skip."""

from __future__ import annotations

import datetime as dt
from typing import Any
from zoneinfo import ZoneInfo

import pytest

from deferral import DAG, TaskGroup
from deferral.context import Context, DagRunInfo, RuntimeTaskInstance
from deferral.exceptions import DagDefinitionError
from deferral.operators import (
    BaseBranchOperator,
    BranchPythonOperator,
    EmptyOperator,
    ShortCircuitOperator,
)
from deferral.operators.branch import branch_skips
from deferral.operators.datetime import BranchDateTimeOperator
from deferral.operators.weekday import BranchDayOfWeekOperator
from deferral.utils.weekday import WeekDay

LOGICAL = dt.datetime(2024, 5, 1, tzinfo=dt.UTC)
BERLIN = ZoneInfo("Europe/Berlin")


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


# -- BranchDayOfWeekOperator, BranchDateTimeOperator ---------------------------------------------
# As Airflow's example_branch_day_of_week_operator and example_branch_datetime_operator write them.


def test_branch_day_of_week_follows_the_logical_dates_day() -> None:
    # LOGICAL is a Wednesday.
    with DAG("weekday_branch", schedule="@daily", start_date=LOGICAL):
        empty_task_1 = EmptyOperator(task_id="branch_true")
        empty_task_2 = EmptyOperator(task_id="branch_false")
        empty_task_3 = EmptyOperator(task_id="branch_weekend")
        empty_task_4 = EmptyOperator(task_id="branch_mid_week")
        branch = BranchDayOfWeekOperator(
            task_id="make_choice",
            follow_task_ids_if_true="branch_true",
            follow_task_ids_if_false="branch_false",
            week_day="Monday",
            use_task_logical_date=True,
        )
        branch_weekend = BranchDayOfWeekOperator(
            task_id="make_weekend_choice",
            follow_task_ids_if_true="branch_weekend",
            follow_task_ids_if_false="branch_mid_week",
            week_day={WeekDay.SATURDAY, WeekDay.SUNDAY, WeekDay.WEDNESDAY},
            use_task_logical_date=True,
        )
        branch >> [empty_task_1, empty_task_2]
        empty_task_2 >> branch_weekend >> [empty_task_3, empty_task_4]
    assert execute(branch) == ("branch_false", {"branch_true"})
    assert execute(branch_weekend) == ("branch_weekend", {"branch_mid_week"})


def test_branch_day_of_week_refuses_a_bad_day() -> None:
    with DAG("weekday_branch_bad"), pytest.raises(DagDefinitionError, match=r"'c'.*Funday"):
        BranchDayOfWeekOperator(
            task_id="c",
            follow_task_ids_if_true="a",
            follow_task_ids_if_false="b",
            week_day="Funday",
        )


def datetime_branch(lower: Any, upper: Any, **kwargs: Any) -> BranchDateTimeOperator:
    with DAG("datetime_branch", start_date=LOGICAL):
        cond = BranchDateTimeOperator(
            task_id="datetime_branch",
            follow_task_ids_if_true=["date_in_range"],
            follow_task_ids_if_false=["date_outside_range"],
            target_upper=upper,
            target_lower=lower,
            use_task_logical_date=True,
            **kwargs,
        )
        cond >> [
            EmptyOperator(task_id="date_in_range"),
            EmptyOperator(task_id="date_outside_range"),
        ]
    return cond


@pytest.mark.parametrize(
    ("lower", "upper", "chosen"),
    [
        # LOGICAL is 2024-05-01 00:00 UTC.
        (dt.datetime(2024, 4, 30, 23), dt.datetime(2024, 5, 1, 1), "date_in_range"),
        (dt.datetime(2024, 5, 1, 1), dt.datetime(2024, 5, 1, 2), "date_outside_range"),
        (None, dt.datetime(2024, 5, 1, tzinfo=dt.UTC), "date_in_range"),
        (dt.datetime(2024, 5, 1, 0, 0, 1), None, "date_outside_range"),
        # Times of day; an upper time before the lower one spans midnight.
        (dt.time(0, 0), dt.time(6, 0), "date_in_range"),
        (dt.time(10, 0), dt.time(11, 0), "date_outside_range"),
        (dt.time(15, 0), dt.time(0, 0), "date_outside_range"),
    ],
)
def test_branch_datetime_compares_with_its_bounds(lower: Any, upper: Any, chosen: str) -> None:
    other = {"date_in_range", "date_outside_range"} - {chosen}
    assert execute(datetime_branch(lower, upper)) == ([chosen], other)


def test_branch_datetime_bounds_in_the_dags_zone() -> None:
    # 2024-05-01 00:00 UTC is 2024-05-01 02:00 in Berlin: 01:00-03:00 there holds it.
    with DAG("datetime_branch_zone", start_date=dt.datetime(2024, 1, 1, tzinfo=BERLIN)):
        cond = BranchDateTimeOperator(
            task_id="c",
            follow_task_ids_if_true="t",
            follow_task_ids_if_false="f",
            target_lower=dt.datetime(2024, 5, 1, 1),
            target_upper=dt.datetime(2024, 5, 1, 3),
            use_task_logical_date=True,
        )
        cond >> [EmptyOperator(task_id="t"), EmptyOperator(task_id="f")]
    assert execute(cond) == ("t", {"f"})


def test_branch_datetime_refuses_no_bounds_and_bad_ones() -> None:
    with pytest.raises(DagDefinitionError, match=r"'datetime_branch'.*both None"):
        datetime_branch(None, None)
    with pytest.raises(DagDefinitionError, match=r"target_upper must be a datetime.*str"):
        datetime_branch(None, "2024-05-01")
