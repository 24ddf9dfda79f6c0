"""depends_on_past, wait_for_downstream, ignore_first_depends_on_past and
wait_for_past_depends_before_skipping: the arguments, and the pure decision the scheduler takes
from the previous run (Airflow 2.10's PrevDagrunDep)."""

from __future__ import annotations

import datetime as dt

import pytest

from deferral import DAG
from deferral.exceptions import DagDefinitionError
from deferral.operators import EmptyOperator
from deferral.states import TaskState
from scheduler.decide import (
    PreviousRun,
    past_dependent_tasks,
    past_depends_met,
    waiting_task_decisions,
)

T = TaskState
START = dt.datetime(2024, 1, 10, tzinfo=dt.UTC)
BEFORE = dt.datetime(2024, 1, 11, tzinfo=dt.UTC)


def previous(**states: list[str]) -> PreviousRun:
    return PreviousRun(BEFORE, states)


def test_default_args_apply_the_flags_and_wait_for_downstream_implies_depends_on_past() -> None:
    with DAG("past", start_date=START, default_args={"depends_on_past": True}) as dag:
        a = EmptyOperator(task_id="a")
        b = EmptyOperator(task_id="b", depends_on_past=False, wait_for_downstream=True)
        c = EmptyOperator(task_id="c", depends_on_past=False)
    assert a.depends_on_past and not a.wait_for_downstream
    assert b.depends_on_past and b.wait_for_downstream
    assert not c.depends_on_past
    assert not a.ignore_first_depends_on_past and not a.wait_for_past_depends_before_skipping
    assert past_dependent_tasks(dag) == {"a", "b"}


def test_a_flag_that_is_not_a_bool_is_refused_by_name() -> None:
    with (
        DAG("bad", start_date=START),
        pytest.raises(DagDefinitionError, match=r"task 't': depends_on_past must be True or False"),
    ):
        EmptyOperator(task_id="t", depends_on_past="yes")


def test_mapped_task_instances_share_the_flags() -> None:
    from deferral.sensors import TimeDeltaSensor

    with DAG("mapped", start_date=START, default_args={"wait_for_downstream": True}):
        mapped = TimeDeltaSensor.partial(task_id="m").expand(delta=[dt.timedelta(1)])
    assert mapped.depends_on_past and mapped.wait_for_downstream


def _dag(**flags: bool) -> tuple[DAG, EmptyOperator]:
    dag = DAG("d", start_date=START, catchup=True)
    task = EmptyOperator(task_id="t", dag=dag, depends_on_past=True, **flags)
    task >> EmptyOperator(task_id="down", dag=dag)
    return dag, task


def test_without_depends_on_past_or_a_previous_run_the_task_may_run() -> None:
    dag = DAG("free", start_date=START)
    free = EmptyOperator(task_id="t", dag=dag)
    assert past_depends_met(free, previous(t=[T.FAILED]), catchup=False)
    _, task = _dag()
    assert past_depends_met(task, None, catchup=True)


@pytest.mark.parametrize(
    ("states", "met"),
    [
        ([T.SUCCESS], True),
        ([T.SKIPPED], True),
        ([T.SUCCESS, T.SKIPPED], True),  # every map index
        ([T.SUCCESS, T.FAILED], False),
        ([T.RUNNING], False),
        ([T.NONE], False),
        ([T.UPSTREAM_FAILED], False),
        ([T.REMOVED], False),  # Airflow counts anything but success and skipped
    ],
)
def test_the_previous_task_instances_must_have_succeeded_or_been_skipped(
    states: list[str], met: bool
) -> None:
    _, task = _dag()
    assert past_depends_met(task, previous(t=states), catchup=False) is met


def test_wait_for_downstream_also_waits_for_the_previous_runs_direct_downstream() -> None:
    _, task = _dag(wait_for_downstream=True)
    done = [T.SUCCESS]
    assert not past_depends_met(task, previous(t=done, down=[T.RUNNING]), catchup=False)
    assert past_depends_met(task, previous(t=done, down=[T.SKIPPED]), catchup=False)
    # A downstream task the previous run lacks holds nothing, as in Airflow.
    assert past_depends_met(task, previous(t=done), catchup=False)
    _, plain = _dag()
    assert past_depends_met(plain, previous(t=done, down=[T.RUNNING]), catchup=False)


def test_a_previous_run_without_the_task_holds_it_unless_ignore_first_and_never_ran() -> None:
    _, task = _dag()
    assert not past_depends_met(task, previous(), catchup=False)
    _, first = _dag(ignore_first_depends_on_past=True)
    assert past_depends_met(first, previous(), catchup=False)
    ran = PreviousRun(BEFORE, {}, frozenset({"t"}))
    assert not past_depends_met(first, ran, catchup=False)


def test_with_catchup_a_previous_run_before_the_start_date_does_not_hold() -> None:
    _, task = _dag()
    early = PreviousRun(START - dt.timedelta(days=1), {"t": [T.FAILED]})
    assert past_depends_met(task, early, catchup=True)
    assert not past_depends_met(task, early, catchup=False)


def test_a_held_task_is_not_scheduled_but_skipped_or_failed_by_its_trigger_rule() -> None:
    dag = DAG("held", start_date=START)
    up = EmptyOperator(task_id="up", dag=dag)
    up >> EmptyOperator(task_id="t", dag=dag, depends_on_past=True)
    up >> EmptyOperator(
        task_id="patient", dag=dag, depends_on_past=True, wait_for_past_depends_before_skipping=True
    )
    held = frozenset({"t", "patient"})
    done = {"up": {-1: T.SUCCESS}, "t": {-1: T.NONE}, "patient": {-1: T.NONE}}
    assert waiting_task_decisions(dag, done, held=held) == {}
    assert waiting_task_decisions(dag, done) == {"t": T.SCHEDULED, "patient": T.SCHEDULED}
    skipped = {**done, "up": {-1: T.SKIPPED}}
    # Airflow's default: the trigger rule's skip does not wait for the past.
    assert waiting_task_decisions(dag, skipped, held=held) == {"t": T.SKIPPED}
    failed = {**done, "up": {-1: T.FAILED}}
    # A failure never waits for it (Airflow's flag is about skipping only).
    assert waiting_task_decisions(dag, failed, held=held) == {
        "t": T.UPSTREAM_FAILED,
        "patient": T.UPSTREAM_FAILED,
    }
