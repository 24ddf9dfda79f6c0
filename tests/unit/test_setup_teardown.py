"""Setup and teardown tasks as Airflow 2.10 has them: marking, the ``with setup >> teardown``
scope, the decorators, their trigger rule, the indirect-setup rule, the run's outcome and what
clearing brings."""

from __future__ import annotations

import pendulum
import pytest

from deferral import DAG
from deferral.authoring.setup_teardown import clearing_with, graph
from deferral.decorators import setup, task, task_group, teardown
from deferral.exceptions import DagDefinitionError
from deferral.operators import EmptyOperator
from deferral.operators.bash import BashOperator
from deferral.states import DagRunState, TaskState
from deferral.trigger_rules import TriggerRule, evaluate, setups_gate
from deferral.utils.task_group import TaskGroup
from scheduler.decide import dag_run_outcome, waiting_task_decisions

T = TaskState
START = pendulum.datetime(2021, 1, 1, tz="UTC")


def edges(dag: DAG) -> set[tuple[str, str]]:
    return {(t.task_id, down) for t in dag.tasks for down in t.downstream_task_ids}


def states(**by_task: str) -> dict[str, dict[int, str]]:
    return {task_id: {-1: state} for task_id, state in by_task.items()}


def test_the_classic_example_with_as_setup_and_as_teardown() -> None:
    """Airflow's example_setup_teardown.py, with deferral's imports."""
    with DAG("example_setup_teardown", start_date=START, catchup=False) as dag:
        root_setup = BashOperator(task_id="root_setup", bash_command="echo hi").as_setup()
        root_normal = BashOperator(task_id="normal", bash_command="echo work")
        root_teardown = BashOperator(task_id="root_teardown", bash_command="echo bye").as_teardown(
            setups=root_setup
        )
        root_setup >> root_normal >> root_teardown
        with TaskGroup("section_1") as section_1:
            inner_setup = BashOperator(task_id="taskgroup_setup", bash_command="echo hi")
            inner_setup.as_setup()
            inner_normal = BashOperator(task_id="normal", bash_command="echo work")
            inner_teardown = BashOperator(task_id="taskgroup_teardown", bash_command="echo bye")
            inner_teardown.as_teardown(setups=inner_setup)
            inner_setup >> inner_normal >> inner_teardown
        root_normal >> section_1
    dag.validate()
    assert root_setup.is_setup and not root_setup.is_teardown
    assert root_teardown.is_teardown and root_teardown.trigger_rule == "all_done_setup_success"
    assert not root_teardown.on_failure_fail_dagrun
    # The group's leaf for what follows it is its work, not its teardown.
    assert section_1.leaves == [inner_normal]
    assert ("normal", "section_1.taskgroup_setup") in edges(dag)


def test_the_taskflow_example_with_decorators_and_the_context_manager() -> None:
    """Airflow's example_setup_teardown_taskflow.py, with deferral's imports."""
    with DAG("example_setup_teardown_taskflow", start_date=START, catchup=False) as dag:

        @task
        def my_first_task() -> None:
            print("Hello 1")

        @task
        def my_second_task() -> None:
            print("Hello 2")

        @task
        def my_third_task() -> None:
            print("Hello 3")

        task_1 = my_first_task()
        task_2 = my_second_task()
        task_3 = my_third_task()
        task_1 >> task_2 >> task_3.as_teardown(setups=task_1)

        @setup
        def outer_setup() -> None:
            print("I am outer_setup")

        @teardown
        def outer_teardown() -> None:
            print("I am outer_teardown")

        @task
        def outer_normal_task() -> None:
            print("I am just a normal task")

        s = outer_setup()
        t = outer_teardown()
        with s >> t:
            outer_normal_task()

        @task_group
        def section_1() -> None:
            @task
            def inner_setup() -> str:
                return "some_cluster_id"

            @task
            def inner_normal_task(cluster_id: str) -> None:
                print(cluster_id)

            @task
            def inner_teardown(cluster_id: str) -> None:
                print(cluster_id)

            inner_normal_task(s := inner_setup()) >> inner_teardown(s).as_teardown()

        s >> section_1() >> t
    dag.validate()
    tasks = dag.task_dict
    assert tasks["my_first_task"].is_setup and tasks["my_third_task"].is_teardown
    assert tasks["outer_setup"].is_setup and tasks["outer_teardown"].is_teardown
    assert tasks["outer_teardown"].trigger_rule == "all_done_setup_success"
    assert tasks["section_1.inner_teardown"].is_teardown
    assert not tasks["section_1.inner_setup"].is_setup  # only an upstream of the teardown
    assert {
        ("my_first_task", "my_second_task"),
        ("my_second_task", "my_third_task"),
        ("my_first_task", "my_third_task"),
        ("outer_setup", "outer_teardown"),
        ("outer_setup", "outer_normal_task"),
        ("outer_normal_task", "outer_teardown"),
        ("outer_setup", "section_1.inner_setup"),
        ("section_1.inner_normal_task", "outer_teardown"),
    } <= edges(dag)
    assert ("section_1.inner_teardown", "outer_teardown") not in edges(dag)


def test_teardown_decorator_with_on_failure_fail_dagrun_and_on_classic_operators() -> None:
    with DAG("flags", start_date=START) as dag:

        @teardown(on_failure_fail_dagrun=True)
        def delete_cluster() -> None: ...

        made = delete_cluster()
        delete = EmptyOperator(task_id="delete").as_teardown(on_failure_fail_dagrun=True)
    assert made.operator.on_failure_fail_dagrun and delete.on_failure_fail_dagrun
    assert dag.task_dict["delete"].is_teardown


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (
            lambda: EmptyOperator(task_id="x").as_teardown().as_setup(),
            "task 'x' cannot be a setup task: it is already a teardown task",
        ),
        (
            lambda: EmptyOperator(task_id="x").as_setup().as_teardown(),
            "task 'x' cannot be a teardown task: it is already a setup task",
        ),
        (
            lambda: EmptyOperator(task_id="x").as_teardown(on_failure_fail_dagrun="yes"),
            "task 'x': on_failure_fail_dagrun must be True or False",
        ),
        (
            lambda: EmptyOperator(task_id="x").__enter__(),
            "task 'x' is used as a context manager, which only setup and teardown tasks can be",
        ),
        (
            lambda: teardown(task(trigger_rule="all_done")(lambda: None)),
            "sets trigger_rule, which a teardown task's is always 'all_done_setup_success'",
        ),
    ],
)
def test_misuse_is_refused_naming_the_task(build: object, message: str) -> None:
    with DAG("misuse", start_date=START), pytest.raises(DagDefinitionError) as refused:
        build()  # type: ignore[operator]
    assert message in str(refused.value)


def test_a_setups_work_task_must_keep_all_success() -> None:
    with DAG("rules", start_date=START) as dag:
        s = EmptyOperator(task_id="s").as_setup()
        s >> EmptyOperator(task_id="w", trigger_rule="all_done")
    with pytest.raises(DagDefinitionError, match="task 'w' is downstream of setup task 's'"):
        dag.validate()


# -- the trigger rule and the indirect setups ------------------------------------------------------


@pytest.mark.parametrize(
    ("upstream", "setups", "expected"),
    [
        ([T.SUCCESS, T.FAILED], [T.SUCCESS], T.SCHEDULED),  # work failed: teardown still runs
        ([T.SUCCESS, T.RUNNING], [T.SUCCESS], None),
        ([T.FAILED, T.UPSTREAM_FAILED], [T.FAILED], T.UPSTREAM_FAILED),
        ([T.SKIPPED, T.SKIPPED], [T.SKIPPED], T.SKIPPED),
        ([T.SUCCESS, T.FAILED, T.SUCCESS], [T.SUCCESS, T.FAILED], T.SCHEDULED),  # one setup ran
        ([T.FAILED], [], T.SCHEDULED),  # no setup upstream: all_done
    ],
)
def test_all_done_setup_success(upstream: list[str], setups: list[str], expected: object) -> None:
    assert evaluate(TriggerRule.ALL_DONE_SETUP_SUCCESS, upstream, setups) == expected


def test_setups_gate() -> None:
    assert setups_gate([T.SUCCESS, T.FAILED]) == T.UPSTREAM_FAILED
    assert setups_gate([T.SUCCESS, T.SKIPPED]) == T.SKIPPED
    assert setups_gate([T.SUCCESS, T.RUNNING]) is None
    assert setups_gate([T.SUCCESS]) == T.SCHEDULED


def _cluster_dag(**teardown_flags: bool) -> DAG:
    """create >> work >> report (all_done) >> delete, delete the teardown of create."""
    with DAG("cluster", start_date=START) as dag:
        create = EmptyOperator(task_id="create")
        work = EmptyOperator(task_id="work")
        report = EmptyOperator(task_id="report", trigger_rule="all_done")
        delete = EmptyOperator(task_id="delete").as_teardown(setups=create, **teardown_flags)
        create >> work >> report >> delete
    return dag


def test_a_teardown_runs_after_failed_work_when_its_setup_succeeded() -> None:
    dag = _cluster_dag()
    decided = waiting_task_decisions(
        dag, states(create=T.SUCCESS, work=T.FAILED, report=T.SUCCESS, delete=T.NONE)
    )
    assert decided == {"delete": T.SCHEDULED}


def test_a_failed_setup_fails_its_work_and_teardown_even_under_all_done() -> None:
    dag = _cluster_dag()
    decided = waiting_task_decisions(
        dag, states(create=T.FAILED, work=T.NONE, report=T.NONE, delete=T.NONE)
    )
    # report's trigger rule (all_done) would run it; its indirect setup failed.
    assert decided == {
        "work": T.UPSTREAM_FAILED,
        "report": T.UPSTREAM_FAILED,
        "delete": T.UPSTREAM_FAILED,
    }
    skipped = waiting_task_decisions(
        dag, states(create=T.SKIPPED, work=T.NONE, report=T.NONE, delete=T.NONE)
    )
    assert skipped == {"work": T.SKIPPED, "report": T.SKIPPED, "delete": T.SKIPPED}


@pytest.mark.parametrize(
    ("work", "delete", "fail_dagrun", "outcome"),
    [
        (T.FAILED, T.SUCCESS, False, DagRunState.FAILED),
        (T.SUCCESS, T.FAILED, False, DagRunState.SUCCESS),
        (T.SUCCESS, T.FAILED, True, DagRunState.FAILED),
        # As Airflow: such a teardown stands alone for the work it follows.
        (T.FAILED, T.SUCCESS, True, DagRunState.SUCCESS),
    ],
)
def test_a_teardown_decides_the_run_only_with_on_failure_fail_dagrun(
    work: str, delete: str, fail_dagrun: bool, outcome: DagRunState
) -> None:
    with DAG("outcome", start_date=START) as dag:
        create = EmptyOperator(task_id="create")
        work_task = EmptyOperator(task_id="work")
        teardown_task = EmptyOperator(task_id="delete")
        teardown_task.as_teardown(setups=create, on_failure_fail_dagrun=fail_dagrun)
        create >> work_task >> teardown_task
    run = states(create=T.SUCCESS, work=work, delete=delete)
    assert dag_run_outcome(dag, run) == outcome
    assert graph(dag).deciding_leaves == ({"delete"} if fail_dagrun else {"work"})


def test_clearing_a_work_task_brings_its_setup_and_teardown() -> None:
    dag = _cluster_dag()
    assert clearing_with(dag, ["work"], downstream=False) == {"work", "create", "delete"}
    assert clearing_with(dag, ["create"], downstream=False) == {"create", "delete"}
    assert clearing_with(dag, ["report"], downstream=True) == {
        "report",
        "delete",
        "create",
    }
    with DAG("plain", start_date=START) as plain:
        EmptyOperator(task_id="a") >> EmptyOperator(task_id="b")
    assert clearing_with(plain, ["a"], downstream=False) == {"a"}
