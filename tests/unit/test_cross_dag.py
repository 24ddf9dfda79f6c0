"""TriggerDagRunOperator, ExternalTaskSensor, ExternalTaskMarker and their triggers, without a
database: what they accept and refuse, the dates a sensor looks at, and the rule that decides
"done", "failed", "skipped" or "not yet" (sensor_helper.external_status)."""

from __future__ import annotations

import datetime as dt
from typing import Any

import pytest

from deferral import DAG
from deferral.exceptions import DagDefinitionError, DagNotFound, DeferralException
from deferral.operators import EmptyOperator
from deferral.operators.trigger_dagrun import TriggerDagRunOperator
from deferral.sensors.external_task import ExternalTaskMarker, ExternalTaskSensor
from deferral.store import seam
from deferral.triggers.external_task import DagStateTrigger, WorkflowTrigger
from deferral.utils.sensor_helper import ExternalStatus, external_status
from deferral.utils.task_group import TaskGroup
from tests.unit.test_operators import make_context

DAY = dt.datetime(2024, 3, 1, tzinfo=dt.UTC)
BEFORE = DAY - dt.timedelta(days=1)


# -- external_status -----------------------------------------------------------------------------


def status(states: dict[tuple[dt.datetime, str], list[str]], **kwargs: Any) -> Any:
    task_ids = kwargs.pop("task_ids", ["a", "b"])
    dates = kwargs.pop("dates", [DAY])
    return external_status(states, dates, task_ids, allowed=["success"], **kwargs)


def test_done_once_every_task_at_every_date_is_allowed() -> None:
    assert status({(DAY, "a"): ["success"], (DAY, "b"): ["success"]}) is ExternalStatus.SUCCESS
    # A task not there yet, or one map index still running: not yet.
    assert status({(DAY, "a"): ["success"]}) is None
    assert status({(DAY, "a"): ["success"], (DAY, "b"): ["success", "running"]}) is None
    # Two dates: both.
    two = {"dates": [BEFORE, DAY]}
    assert status({(DAY, "a"): ["success"], (DAY, "b"): ["success"]}, **two) is None
    # Nothing at all to wait for is never done.
    assert status({}, task_ids=["a"]) is None


def test_failed_before_skipped_before_done_and_any_one_counts() -> None:
    states = {(DAY, "a"): ["failed"], (DAY, "b"): ["skipped"]}
    assert status(states, failed=["failed"], skipped=["skipped"]) is ExternalStatus.FAILED
    assert status(states, skipped=["skipped"]) is ExternalStatus.SKIPPED
    assert status(states) is None  # neither failed nor skipped states given: waits


def test_a_run_itself_is_keyed_without_a_task_id() -> None:
    assert external_status({(DAY, ""): ["failed"]}, [DAY], None, allowed=["success", "failed"]) is (
        ExternalStatus.SUCCESS
    )


# -- ExternalTaskSensor --------------------------------------------------------------------------


def sensor(**kwargs: Any) -> ExternalTaskSensor:
    with DAG("ets_dag", start_date=DAY):
        return ExternalTaskSensor(task_id="s", external_dag_id="other", **kwargs)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"external_task_id": "a", "external_task_ids": ["a"]}, "not both"),
        ({"external_task_group_id": "g", "external_task_id": "a"}, "excludes"),
        ({"external_task_ids": ["a", "a"]}, "twice"),
        ({"external_task_id": "a", "allowed_states": ["done"]}, "'done' is not a task state"),
        ({"allowed_states": ["skipped"]}, "'skipped' is not a DAG run state"),
        ({"allowed_states": ["success"], "failed_states": ["success"]}, "both allowed and"),
        ({"failed_states": "failed"}, "failed_states must be a list of states"),
        (
            {"execution_delta": dt.timedelta(1), "execution_date_fn": lambda d: d},
            "execution_delta or execution_date_fn",
        ),
        ({"execution_date_fn": "yesterday"}, "execution_date_fn must be callable"),
        ({"poll_interval": 0}, "poll_interval must be a number of seconds > 0"),
    ],
)
def test_sensor_refuses_bad_arguments_naming_the_task(kwargs: Any, message: str) -> None:
    with pytest.raises(DagDefinitionError, match=message) as refused:
        sensor(**kwargs)
    assert str(refused.value).startswith("task 's': ")


def test_sensor_dates_from_delta_and_from_a_function_of_the_context() -> None:
    assert sensor(execution_delta=dt.timedelta(days=1)).logical_dates(make_context_at(DAY)) == [
        BEFORE
    ]

    def both_days(logical_date: dt.datetime, ds: str) -> list[dt.datetime]:
        assert ds == "2024-03-01"
        return [logical_date - dt.timedelta(days=1), logical_date]

    assert sensor(execution_date_fn=both_days).logical_dates(make_context_at(DAY)) == [
        BEFORE,
        DAY,
    ]
    naive = sensor(execution_date_fn=lambda d: d.replace(tzinfo=None))
    with pytest.raises(TypeError, match="tz-aware"):
        naive.logical_dates(make_context_at(DAY))


def make_context_at(logical_date: dt.datetime) -> Any:
    task = sensor()
    context = make_context(task, logical_date=logical_date)
    context["ds"] = logical_date.strftime("%Y-%m-%d")
    return context


def test_deferrable_sensor_hands_its_wait_to_a_workflow_trigger() -> None:
    trigger = WorkflowTrigger(
        external_dag_id="other",
        logical_dates=[DAY],
        external_task_ids=["a"],
        failed_states=["failed"],
        poll_interval=0.5,
    )
    classpath, kwargs = trigger.serialize()
    assert classpath == "deferral.triggers.external_task.WorkflowTrigger"
    assert WorkflowTrigger(**kwargs).serialize() == (classpath, kwargs)
    with pytest.raises(ValueError, match="tz-aware"):
        WorkflowTrigger(external_dag_id="other", logical_dates=[DAY.replace(tzinfo=None)])
    with pytest.raises(ValueError, match="poll_interval"):
        WorkflowTrigger(external_dag_id="other", logical_dates=[DAY], poll_interval=0)


# -- TriggerDagRunOperator -----------------------------------------------------------------------


def trigger_op(**kwargs: Any) -> TriggerDagRunOperator:
    with DAG("tdr_dag", start_date=DAY):
        return TriggerDagRunOperator(task_id="t", trigger_dag_id="target", **kwargs)


def test_trigger_dag_run_defaults_and_templated_fields_as_airflow() -> None:
    op = trigger_op()
    assert op.allowed_states == ["success"] and op.failed_states == ["failed"]
    assert op.poke_interval == 60 and not op.wait_for_completion and not op.reset_dag_run
    assert set(op.template_fields) == {
        "trigger_dag_id",
        "trigger_run_id",
        "logical_date",
        "conf",
        "wait_for_completion",
        "skip_when_already_exists",
    }
    # An empty failed_states means none, as in Airflow; execution_date is Airflow 2's name.
    assert trigger_op(failed_states=[]).failed_states == []
    assert trigger_op(execution_date="{{ ds }}").logical_date == "{{ ds }}"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"allowed_states": ["done"]}, "allowed_states holds 'done', not a DAG run state"),
        ({"logical_date": 20240301}, "logical_date must be a datetime or a string"),
        ({"logical_date": DAY, "execution_date": DAY}, "not both"),
        ({"poke_interval": 0}, "poke_interval must be > 0"),
    ],
)
def test_trigger_dag_run_refuses_bad_arguments(kwargs: Any, message: str) -> None:
    with pytest.raises(DagDefinitionError, match=message):
        trigger_op(**kwargs)


def test_dag_state_trigger_round_trips_and_takes_airflow_2_name() -> None:
    trigger = DagStateTrigger(dag_id="target", states=["success"], execution_dates=[DAY])
    classpath, kwargs = trigger.serialize()
    assert kwargs["logical_dates"] == [DAY]
    assert DagStateTrigger(**kwargs).serialize() == (classpath, kwargs)
    with pytest.raises(TypeError, match="not both"):
        DagStateTrigger(dag_id="x", states=["success"], logical_dates=[DAY], execution_dates=[DAY])


# -- ExternalTaskMarker --------------------------------------------------------------------------


def test_marker_date_defaults_to_the_runs_and_depth_must_be_positive() -> None:
    with DAG("marker_dag", start_date=DAY):
        marker = ExternalTaskMarker(task_id="m", external_dag_id="o", external_task_id="t")
        dated = ExternalTaskMarker(
            task_id="d", external_dag_id="o", external_task_id="t", execution_date=DAY
        )
        with pytest.raises(DagDefinitionError, match="'z': recursion_depth must be > 0"):
            ExternalTaskMarker(
                task_id="z", external_dag_id="o", external_task_id="t", recursion_depth=0
            )
    assert marker.logical_date == "{{ logical_date.isoformat() }}"
    assert marker.recursion_depth == 10
    assert dated.logical_date == DAY.isoformat()


class _Dags:
    """A task runtime that knows one DAG (what ExternalTaskSensor asks of it here)."""

    def __init__(self, dag: DAG) -> None:
        self.dag = dag

    def get_dag(self, dag_id: str) -> DAG:
        if dag_id != self.dag.dag_id:
            raise DagNotFound(dag_id)
        return self.dag

    def trigger_run(self, *args: Any, **kwargs: Any) -> None:
        raise AssertionError("not asked")

    def clear_run(self, *args: Any, **kwargs: Any) -> None:
        raise AssertionError("not asked")


def test_a_task_group_that_does_not_exist_fails_the_sensor_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """As Airflow 3 (its API answers 404), whatever check_existence says."""
    with DAG("other", start_date=DAY) as other, TaskGroup("grp"):
        EmptyOperator(task_id="a")
    monkeypatch.setattr(seam, "_task_runtime", _Dags(other))
    with DAG("waits", start_date=DAY):
        found = ExternalTaskSensor(
            task_id="s", external_dag_id="other", external_task_group_id="grp"
        )
        missing = ExternalTaskSensor(
            task_id="m", external_dag_id="other", external_task_group_id="nope"
        )
        no_dag = ExternalTaskSensor(task_id="n", external_dag_id="gone", external_task_group_id="g")
    assert found.task_ids() == ["grp.a"]
    with pytest.raises(DeferralException, match="external task group 'nope' of DAG 'other'"):
        missing.task_ids()
    with pytest.raises(DeferralException, match="external task group 'g' of DAG 'gone'"):
        no_dag.task_ids()
