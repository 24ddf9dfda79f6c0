"""deferral.authoring.callbacks: checking, running, and DAG callbacks."""

from __future__ import annotations

import datetime as dt
import logging
from typing import Any

import pytest

from deferral import DAG
from deferral.authoring.callbacks import (
    REASON_SUCCESS,
    REASON_TASK_FAILURE,
    run_callbacks,
    run_dag_callbacks,
)
from deferral.context import DagRunInfo, RuntimeTaskInstance
from deferral.exceptions import DagDefinitionError
from deferral.operators import EmptyOperator

LOGICAL = dt.datetime(2024, 5, 1, tzinfo=dt.UTC)
RUN = DagRunInfo("cb", "run_1", LOGICAL, {"from_conf": 1})


class NoXComs:
    def push(self, task_instance_id: int, key: str, value: Any) -> None: ...

    def pull(self, dag_id: str, run_id: str, task_id: str, key: str, map_index: int | None) -> Any:
        return None


@pytest.mark.parametrize(
    "name",
    [
        "on_execute_callback",
        "on_success_callback",
        "on_failure_callback",
        "on_retry_callback",
        "on_skipped_callback",
    ],
)
def test_task_callbacks_accept_a_callable_or_a_list_and_refuse_anything_else(name: str) -> None:
    def one(context: Any) -> None:
        return None

    with DAG("cb"):
        assert getattr(EmptyOperator(task_id="a", **{name: one}), name) is one
        assert getattr(EmptyOperator(task_id="b", **{name: [one, print]}), name) == [one, print]
        assert getattr(EmptyOperator(task_id="c"), name) is None
        with pytest.raises(
            DagDefinitionError, match=f"task 'd': {name} must be a callable or a list of callables"
        ):
            EmptyOperator(task_id="d", **{name: "not callable"})
        with pytest.raises(DagDefinitionError, match=f"task 'e': {name} must be"):
            EmptyOperator(task_id="e", **{name: [one, 5]})


def test_task_callbacks_and_do_xcom_push_come_from_default_args() -> None:
    def notify(context: Any) -> None:
        return None

    with DAG("cb", default_args={"on_failure_callback": notify, "do_xcom_push": False}) as dag:
        EmptyOperator(task_id="a")
        EmptyOperator(task_id="b", on_failure_callback=None, do_xcom_push=True)
    assert dag.task_dict["a"].on_failure_callback is notify
    assert dag.task_dict["a"].do_xcom_push is False
    assert dag.task_dict["b"].on_failure_callback is None
    assert dag.task_dict["b"].do_xcom_push is True


def test_dag_callbacks_are_checked_naming_the_dag() -> None:
    with pytest.raises(DagDefinitionError, match="DAG 'bad': on_failure_callback must be"):
        DAG("bad", on_failure_callback=3)  # type: ignore[arg-type]


def test_run_callbacks_calls_each_in_order_and_one_that_raises_does_not_stop_the_next(
    caplog: pytest.LogCaptureFixture,
) -> None:
    calls: list[str] = []

    def first(context: Any) -> None:
        calls.append(f"first {context['x']}")
        raise ValueError("first broke\nsecond line")

    def second(context: Any) -> None:
        calls.append(f"second {context['x']}")

    with caplog.at_level(logging.ERROR, logger="deferral.authoring.callbacks"):
        errors = run_callbacks([first, second], {"x": 1}, what="task 't' on_failure_callback")
    assert calls == ["first 1", "second 1"]
    assert errors == [
        "task 't' on_failure_callback "
        "test_run_callbacks_calls_each_in_order_and_one_that_raises_does_not_stop_the_next"
        ".<locals>.first raised ValueError: first broke"
    ]
    assert "first broke" in caplog.text
    assert run_callbacks(None, {}, what="nothing") == []


def test_run_dag_callbacks_calls_the_success_or_failure_callbacks_with_the_runs_context() -> None:
    seen: list[tuple[str, dict[str, Any]]] = []
    with DAG(
        "cb",
        params={"p": 0},
        on_success_callback=lambda context: seen.append(("success", context)),
        on_failure_callback=[
            lambda context: seen.append(("failure", context)),
            lambda context: seen.append(("failure2", context)),
        ],
    ) as dag:
        EmptyOperator(task_id="t")

    assert run_dag_callbacks(dag, RUN, success=True, reason=REASON_SUCCESS) == []
    kind, context = seen.pop()
    assert kind == "success"
    assert context["reason"] == "success"
    assert context["dag"] is dag and context["dag_run"] is RUN
    assert (context["run_id"], context["logical_date"]) == ("run_1", LOGICAL)
    assert context["params"] == {"p": 0, "from_conf": 1}
    assert "ti" not in context

    ti = RuntimeTaskInstance(9, "cb", "run_1", "t", -1, 1, NoXComs(), LOGICAL)
    assert run_dag_callbacks(dag, RUN, success=False, reason=REASON_TASK_FAILURE, ti=ti) == []
    assert [kind for kind, _ in seen] == ["failure", "failure2"]
    context = seen[0][1]
    assert context["reason"] == "task_failure"
    assert context["ti"] is ti and context["task_instance"] is ti
    assert context["task"] is dag.task_dict["t"]


def test_run_dag_callbacks_reports_a_raising_callback_and_runs_the_rest() -> None:
    ran: list[int] = []

    def broken(context: Any) -> None:
        raise RuntimeError("webhook down")

    with DAG("cb", on_failure_callback=[broken, lambda context: ran.append(1)]) as dag:
        pass
    errors = run_dag_callbacks(dag, RUN, success=False, reason=REASON_TASK_FAILURE)
    assert len(errors) == 1
    assert errors[0].startswith("DAG 'cb' on_failure_callback ")
    assert errors[0].endswith("broken raised RuntimeError: webhook down")
    assert ran == [1]


def test_run_dag_callbacks_without_callbacks_does_nothing() -> None:
    with DAG("cb") as dag:
        pass
    assert run_dag_callbacks(dag, RUN, success=True, reason=REASON_SUCCESS) == []
