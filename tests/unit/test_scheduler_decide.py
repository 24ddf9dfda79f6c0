"""scheduler.decide: pure scheduling decisions."""

from __future__ import annotations

import datetime as dt

import pytest

from deferral import DAG, chain
from deferral.operators import EmptyOperator
from deferral.states import DagRunState, TaskState
from scheduler.decide import (
    Ready,
    RunProbes,
    choose_dispatch,
    dag_run_outcome,
    dispatch_budget,
    needs_evaluation,
    next_try_at,
    plan_dispatch,
    run_outcome,
    tasks_of_run,
    waiting_task_decisions,
)

T = TaskState


def linear(n: int, **rules: str) -> DAG:
    """t0 >> t1 >> ... with per-task trigger rules."""
    dag = DAG(f"linear{n}")
    tasks = [EmptyOperator(task_id=f"t{i}", dag=dag, **_rule(rules, f"t{i}")) for i in range(n)]
    chain(*tasks)
    return dag


def unmapped(states: dict[str, str]) -> dict[str, dict[int, str]]:
    """Run states of unmapped tasks: each task's one task instance, map index -1."""
    return {task_id: {-1: state} for task_id, state in states.items()}


def _rule(rules: dict[str, str], task_id: str) -> dict[str, str]:
    return {"trigger_rule": rules[task_id]} if task_id in rules else {}


# -- waiting_task_decisions ------------------------------------------------------------------------


def test_root_tasks_are_scheduled() -> None:
    dag = linear(3)
    decisions = waiting_task_decisions(dag, unmapped({"t0": "none", "t1": "none", "t2": "none"}))
    assert decisions == {"t0": T.SCHEDULED}


def test_upstream_failed_cascades_down_a_chain_in_one_call() -> None:
    dag = linear(5)
    states = {"t0": "failed", "t1": "none", "t2": "none", "t3": "none", "t4": "none"}
    assert waiting_task_decisions(dag, unmapped(states)) == {
        "t1": T.UPSTREAM_FAILED,
        "t2": T.UPSTREAM_FAILED,
        "t3": T.UPSTREAM_FAILED,
        "t4": T.UPSTREAM_FAILED,
    }


def test_cascade_stops_at_all_done_task_which_runs() -> None:
    dag = linear(4, t2="all_done")
    states = {"t0": "failed", "t1": "none", "t2": "none", "t3": "none"}
    assert waiting_task_decisions(dag, unmapped(states)) == {
        "t1": T.UPSTREAM_FAILED,
        "t2": T.SCHEDULED,
    }


def test_skip_cascades_and_one_failed_after_upstream_failed_runs() -> None:
    dag = linear(3)
    assert waiting_task_decisions(dag, unmapped({"t0": "skipped", "t1": "none", "t2": "none"})) == {
        "t1": T.SKIPPED,
        "t2": T.SKIPPED,
    }
    dag2 = linear(3, t2="one_failed")
    assert waiting_task_decisions(dag2, unmapped({"t0": "failed", "t1": "none", "t2": "none"})) == {
        "t1": T.UPSTREAM_FAILED,
        "t2": T.SCHEDULED,
    }


def test_cascade_is_independent_of_task_declaration_order() -> None:
    dag = DAG("reversed")
    c = EmptyOperator(task_id="c", dag=dag)
    b = EmptyOperator(task_id="b", dag=dag)
    a = EmptyOperator(task_id="zz_a", dag=dag)
    a >> b >> c
    decisions = waiting_task_decisions(dag, unmapped({"zz_a": "failed", "b": "none", "c": "none"}))
    assert decisions == {"b": T.UPSTREAM_FAILED, "c": T.UPSTREAM_FAILED}


def test_only_tasks_in_state_none_are_decided() -> None:
    dag = linear(3)
    states = {"t0": "success", "t1": "running", "t2": "none"}
    assert waiting_task_decisions(dag, unmapped(states)) == {}
    states = {"t0": "success", "t1": "success", "t2": "queued"}
    assert waiting_task_decisions(dag, unmapped(states)) == {}


def test_waiting_on_deferred_upstream_is_undecided() -> None:
    dag = linear(2)
    assert waiting_task_decisions(dag, unmapped({"t0": "deferred", "t1": "none"})) == {}


def test_diamond_with_one_branch_failed_and_join_none_failed_min_one_success() -> None:
    dag = DAG("diamond")
    start, left, right = (EmptyOperator(task_id=t, dag=dag) for t in ("start", "left", "right"))
    join = EmptyOperator(task_id="join", dag=dag, trigger_rule="none_failed_min_one_success")
    start >> [left, right] >> join
    states = {"start": "success", "left": "success", "right": "skipped", "join": "none"}
    assert waiting_task_decisions(dag, unmapped(states)) == {"join": T.SCHEDULED}
    states = {"start": "success", "left": "running", "right": "skipped", "join": "none"}
    assert waiting_task_decisions(dag, unmapped(states)) == {}


def test_input_states_are_not_mutated() -> None:
    dag = linear(3)
    states = unmapped({"t0": "failed", "t1": "none", "t2": "none"})
    before = {task_id: dict(by_index) for task_id, by_index in states.items()}
    waiting_task_decisions(dag, states)
    assert states == before


# -- dag_run_outcome -------------------------------------------------------------------------------


def test_run_outcome_none_while_any_task_unfinished() -> None:
    dag = linear(3)
    for unfinished in ("none", "scheduled", "queued", "running", "deferred", "up_for_retry"):
        states = {"t0": "success", "t1": "success", "t2": unfinished}
        assert dag_run_outcome(dag, unmapped(states)) is None, unfinished


def test_run_outcome_success_when_all_succeeded() -> None:
    dag = linear(2)
    assert dag_run_outcome(dag, unmapped({"t0": "success", "t1": "success"})) is DagRunState.SUCCESS


@pytest.mark.parametrize("leaf_state", ["failed", "upstream_failed"])
def test_run_outcome_failed_when_a_leaf_failed(leaf_state: str) -> None:
    dag = linear(2)
    assert dag_run_outcome(dag, unmapped({"t0": "success", "t1": leaf_state})) is DagRunState.FAILED


def test_run_outcome_success_when_only_a_non_leaf_failed() -> None:
    dag = linear(2, t1="all_done")
    assert dag_run_outcome(dag, unmapped({"t0": "failed", "t1": "success"})) is DagRunState.SUCCESS


def test_run_outcome_skipped_leaf_is_success() -> None:
    dag = linear(2)
    assert dag_run_outcome(dag, unmapped({"t0": "skipped", "t1": "skipped"})) is DagRunState.SUCCESS


def test_run_outcome_one_of_several_leaves_failed() -> None:
    dag = DAG("fan")
    root = EmptyOperator(task_id="root", dag=dag)
    leaves = [EmptyOperator(task_id=f"leaf{i}", dag=dag) for i in range(3)]
    root >> leaves
    states = {"root": "success", "leaf0": "success", "leaf1": "failed", "leaf2": "skipped"}
    assert dag_run_outcome(dag, unmapped(states)) is DagRunState.FAILED


# -- next_try_at / dispatch_budget ----------------------------------------------------------------

NOW = dt.datetime(2024, 1, 1, 12, 0, tzinfo=dt.UTC)


def test_next_try_at() -> None:
    delay = dt.timedelta(minutes=5)
    assert next_try_at(None, delay, NOW) == NOW
    assert next_try_at(NOW - dt.timedelta(minutes=1), delay, NOW) == NOW + dt.timedelta(minutes=4)
    assert next_try_at(NOW, dt.timedelta(0), NOW) == NOW


def test_dispatch_budget_never_negative() -> None:
    assert dispatch_budget(1, 3) == 0
    assert dispatch_budget(0, 0) == 0
    assert dispatch_budget(4, 0) == 4
    assert dispatch_budget(5, 2) == 3


def test_upstream_without_a_state_keeps_its_downstream_waiting() -> None:
    dag = linear(3)  # t0 >> t1 >> t2; t1 has no task instance in this run
    decisions = waiting_task_decisions(dag, unmapped({"t0": "running", "t2": "none"}))
    assert "t2" not in decisions


# -- choose_dispatch: priorities, run budgets, pools -----------------------------------------------

R1, R2 = ("d", "r1"), ("d", "r2")


def test_choose_dispatch_takes_highest_priority_within_the_run_budget() -> None:
    ready = [Ready(1, R1, "p", 1, 1), Ready(2, R1, "p", 1, 9), Ready(3, R1, "p", 1, 5)]
    assert choose_dispatch(ready, run_budget={R1: 2}, pool_free={"p": 10}, resumed_first=True) == [
        2,
        3,
    ]


def test_choose_dispatch_budgets_are_per_run() -> None:
    ready = [Ready(1, R1, "p", 1, 1), Ready(2, R1, "p", 1, 1), Ready(3, R2, "p", 1, 1)]
    assert choose_dispatch(
        ready, run_budget={R1: 1, R2: 5}, pool_free={"p": 10}, resumed_first=True
    ) == [1, 3]
    assert choose_dispatch(ready, run_budget={R2: 5}, pool_free={"p": 10}, resumed_first=True) == [
        3
    ]


def test_choose_dispatch_respects_pool_slots_and_lets_small_tasks_past_a_big_one() -> None:
    ready = [
        Ready(1, R1, "p", 3, 9),
        Ready(2, R1, "p", 1, 5),
        Ready(3, R1, "p", 1, 1),
        Ready(4, R1, "q", 1, 1),
    ]
    assert choose_dispatch(
        ready, run_budget={R1: 10}, pool_free={"p": 2, "q": 0}, resumed_first=True
    ) == [2, 3]


def test_choose_dispatch_leaves_tasks_of_unknown_pools_waiting() -> None:
    assert (
        choose_dispatch(
            [Ready(1, R1, "nope", 1, 1)], run_budget={R1: 5}, pool_free={}, resumed_first=True
        )
        == []
    )


def test_plan_dispatch_says_what_pools_and_runs_have_left() -> None:
    ready = [Ready(1, R1, "p", 2, 1), Ready(2, R2, "p", 1, 1), Ready(3, R2, "p", 1, 1)]
    plan = plan_dispatch(
        ready, run_budget={R1: 1, R2: 1}, pool_free={"p": 5, "q": 1}, resumed_first=True
    )
    assert plan.chosen == [1, 2]
    assert plan.pool_free == {"p": 2, "q": 1}
    assert plan.run_budget == {R1: 0, R2: 0}


# -- after a branch or a short circuit skipped tasks ----------------------------------------------


def branched(join_rule: str) -> DAG:
    """branch >> [a, b] >> join >> after, then the branch chose a (b was skipped)."""
    dag = DAG(f"branched_{join_rule}")
    branch, a, b = (EmptyOperator(task_id=t, dag=dag) for t in ("branch", "a", "b"))
    join = EmptyOperator(task_id="join", dag=dag, trigger_rule=join_rule)
    after = EmptyOperator(task_id="after", dag=dag)
    branch >> [a, b] >> join >> after
    return dag


@pytest.mark.parametrize(
    ("join_rule", "decision"),
    [
        ("none_failed_min_one_success", T.SCHEDULED),
        ("none_failed", T.SCHEDULED),
        ("one_success", T.SCHEDULED),
        ("all_done", T.SCHEDULED),
        ("all_success", T.SKIPPED),
        ("none_skipped", T.SKIPPED),
    ],
)
def test_a_join_after_a_branch_follows_its_trigger_rule_as_in_airflow(
    join_rule: str, decision: TaskState
) -> None:
    dag = branched(join_rule)
    states = {"branch": T.SUCCESS, "a": T.SUCCESS, "b": T.SKIPPED, "join": T.NONE, "after": T.NONE}
    decisions = waiting_task_decisions(dag, unmapped(states))
    assert decisions["join"] == decision
    # What follows a skipped join is skipped in turn (all_success), a scheduled one waits.
    assert decisions.get("after") == (T.SKIPPED if decision == T.SKIPPED else None)


def test_a_join_whose_upstream_were_all_skipped_is_skipped() -> None:
    dag = branched("none_failed_min_one_success")
    states = {"branch": T.SUCCESS, "a": T.SKIPPED, "b": T.SKIPPED, "join": T.NONE, "after": T.NONE}
    assert waiting_task_decisions(dag, unmapped(states)) == {"join": T.SKIPPED, "after": T.SKIPPED}


def test_a_run_whose_leaves_were_skipped_by_a_branch_succeeds() -> None:
    dag = branched("all_success")
    states = {
        "branch": T.SUCCESS,
        "a": T.SUCCESS,
        "b": T.SKIPPED,
        "join": T.SKIPPED,
        "after": T.SKIPPED,
    }
    assert dag_run_outcome(dag, unmapped(states)) == DagRunState.SUCCESS


# -- needs_evaluation: whether anything of a marked run must be read -------------------------------


@pytest.mark.parametrize(
    ("probes", "checked", "expected"),
    [
        (RunProbes(waiting=False, retries_undue=False, unfinished=True), True, False),
        (RunProbes(waiting=True, retries_undue=False, unfinished=True), True, True),
        (RunProbes(waiting=False, retries_undue=True, unfinished=True), True, True),
        (RunProbes(waiting=False, retries_undue=False, unfinished=False), True, True),
        (RunProbes(waiting=False, retries_undue=False, unfinished=True), False, True),
    ],
    ids=["all-running-or-deferred", "a-task-waits", "a-retry-undue", "all-finished", "unchecked"],
)
def test_needs_evaluation(probes: RunProbes, checked: bool, expected: bool) -> None:
    assert needs_evaluation(probes, checked_against_dag=checked) is expected


def test_run_outcome_from_probes() -> None:
    assert run_outcome(unfinished=True, leaf_failed=True) is None
    assert run_outcome(unfinished=False, leaf_failed=False) is DagRunState.SUCCESS
    assert run_outcome(unfinished=False, leaf_failed=True) is DagRunState.FAILED


@pytest.mark.parametrize(("resumed_first", "expected"), [(True, [3, 1]), (False, [1, 2])])
def test_a_resumed_task_goes_ahead_of_new_work_of_equal_weight_unless_turned_off(
    resumed_first: bool, expected: list[int]
) -> None:
    ready = [
        Ready(1, R1, "p", 1, 5),
        Ready(2, R1, "p", 1, 5),
        Ready(3, R2, "p", 1, 5, resumed=True),
        Ready(4, R2, "p", 1, 1, resumed=True),  # resumed, but of a lower weight: after them
        Ready(5, R2, "p", 1, 9),  # new, of a higher weight: first whatever the setting
    ]
    budget = {R1: 5, R2: 5}
    chosen = choose_dispatch(
        ready, run_budget=budget, pool_free={"p": 3}, resumed_first=resumed_first
    )
    assert chosen == [5, *expected]


_START, _END = dt.datetime(2024, 1, 1, tzinfo=dt.UTC), dt.datetime(2024, 12, 31, tzinfo=dt.UTC)


@pytest.mark.parametrize(
    ("run_type", "logical_date", "created"),
    [
        ("manual", _START, True),
        ("manual", _START - dt.timedelta(days=1), False),  # before the DAG's start_date
        ("scheduled", _END + dt.timedelta(days=1), False),  # after its end_date
        ("backfill", _START - dt.timedelta(days=1), True),  # a backfill's run: every task
        ("asset_triggered", None, True),
    ],
)
def test_a_run_outside_the_dags_dates_gets_no_task(
    run_type: str, logical_date: dt.datetime | None, created: bool
) -> None:
    with DAG("dated", start_date=_START, end_date=_END) as dag:
        EmptyOperator(task_id="a") >> EmptyOperator(task_id="b")
    tasks = tasks_of_run(dag, run_type, logical_date)
    assert [t.task_id for t in tasks] == (["a", "b"] if created else [])


def test_runs_are_decidable_together_unless_a_task_maps_or_waits_on_the_past() -> None:
    from deferral.operators import BashOperator
    from scheduler.decide import decidable_together

    plain = linear(3, t2="all_done")
    assert decidable_together(plain)

    with DAG("maps") as maps:
        EmptyOperator(task_id="up") >> BashOperator.partial(task_id="m").expand(
            bash_command=["a", "b"]
        )
    assert not decidable_together(maps)

    with DAG("past") as past:
        EmptyOperator(task_id="a") >> EmptyOperator(task_id="b", depends_on_past=True)
    assert not decidable_together(past)
