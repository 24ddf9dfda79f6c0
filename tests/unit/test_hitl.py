"""Human in the loop and deadline alerts, the pure parts: what a task may ask, what a response
may say (each bad input refused in one line naming it), the operators' checks, the deadlines'
arithmetic and the sla mapping."""

from __future__ import annotations

import datetime as dt
from typing import Any

import pytest

from deferral import DAG
from deferral.deadline import (
    AsyncCallback,
    DeadlineAlert,
    DeadlineReference,
    SyncCallback,
    run_callback,
)
from deferral.exceptions import DagDefinitionError, HITLTimeoutError, TaskAwaitingInput
from deferral.models.param import Param
from deferral.operators.empty import EmptyOperator
from deferral.operators.hitl import ApprovalOperator, HITLBranchOperator, HITLOperator
from deferral.store.hitl import (
    MAX_OPTIONS,
    MAX_PARAMS_BYTES,
    InputRequest,
    ResponseError,
    check_request,
    check_response,
)
from deferral.store.tables import HITLDetail

T0 = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)


def _request(**changes: Any) -> InputRequest:
    values: dict[str, Any] = {
        "subject": "s",
        "body": None,
        "options": ("a", "b"),
        "defaults": None,
        "multiple": False,
        "params": {},
        "timeout": None,
    }
    return InputRequest(**{**values, **changes})


@pytest.mark.parametrize(
    ("changes", "said"),
    [
        ({"options": ()}, "options must not be empty"),
        ({"options": tuple(str(i) for i in range(MAX_OPTIONS + 1))}, "at most 100"),
        ({"options": ("a", "a")}, "options must be unique"),
        ({"options": ("x" * 201,)}, "at most 200 characters"),
        ({"defaults": ("c",)}, "defaults ['c'] are not among the options"),
        ({"defaults": ("a", "b")}, "more than one default when multiple is False"),
        ({"body": "x" * 20_001}, "body longer than 20000"),
        ({"params": {"p": "x" * MAX_PARAMS_BYTES}}, "params larger than"),
    ],
)
def test_a_bad_request_is_refused_in_one_line(changes: dict[str, Any], said: str) -> None:
    with pytest.raises(ValueError, match="task 't'") as caught:
        check_request(_request(**changes), "task 't'")
    assert said in str(caught.value) and "\n" not in str(caught.value)


def _detail(multiple: bool = False, params: dict[str, Any] | None = None) -> HITLDetail:
    return HITLDetail(options=["a", "b"], multiple=multiple, params=params or {})


@pytest.mark.parametrize(
    ("chosen", "params", "said"),
    [
        (["c"], None, "unknown option 'c': expected one of ['a', 'b']"),
        ([], None, "chosen_options must be a non-empty list"),
        ("a", None, "chosen_options must be a non-empty list"),
        (["a", "b"], None, "only one option may be chosen"),
        (["a"] * 101, None, "101 chosen options, at most 100"),
        (["a"], {"nope": 1}, "unknown param 'nope'"),
        (["a"], [["n", 1]], "params_input must be a JSON object"),
        (["a"], {"n": "x" * MAX_PARAMS_BYTES}, "params_input larger than"),
    ],
)
def test_a_bad_response_is_refused_in_one_line(chosen: Any, params: Any, said: str) -> None:
    with pytest.raises(ResponseError) as caught:
        check_response(_detail(params={"n": Param(1).dump()}), chosen, params)
    assert said in str(caught.value) and "\n" not in str(caught.value)


def test_a_response_is_checked_against_the_params_schemas() -> None:
    detail = _detail(multiple=True, params={"n": Param(1, type="integer").dump()})
    assert check_response(detail, ["b", "a"], None) == (["b", "a"], {"n": 1})
    assert check_response(detail, ["a"], {"n": 5}) == (["a"], {"n": 5})
    with pytest.raises(ResponseError, match="param 'n': 'x' is invalid"):
        check_response(detail, ["a"], {"n": "x"})


def test_the_operators_check_what_they_ask_when_the_dag_loads() -> None:
    with DAG("h"):
        with pytest.raises(ValueError, match="Passing options to ApprovalOperator"):
            ApprovalOperator(task_id="a", subject="s", options=["x"])
        with pytest.raises(ValueError, match="defaults"):
            HITLOperator(task_id="b", subject="s", options=["x"], defaults="y")
        with pytest.raises(ValueError, match="options_mapping key 'z' is not an option"):
            HITLBranchOperator(task_id="c", subject="s", options=["x"], options_mapping={"z": "x"})
        asked = HITLOperator(
            task_id="d", subject="s", options=["x"], execution_timeout=dt.timedelta(minutes=5)
        )
    # The timeout is the wait's, never enforced on execute: the wait is not execution.
    assert asked.execution_timeout is None and asked.response_timeout == dt.timedelta(minutes=5)
    with pytest.raises(TaskAwaitingInput) as caught:
        asked.execute({})  # type: ignore[arg-type]
    assert caught.value.request.options == ("x",)
    with pytest.raises(HITLTimeoutError, match="no default options"):
        asked.execute_complete({}, {"chosen_options": None, "timedout": True})  # type: ignore[arg-type]


def test_a_rejection_skips_downstream_tasks_an_approval_none() -> None:
    class TI:
        def __init__(self) -> None:
            self.skip_task_ids: set[str] = set()

    with DAG("r"):
        approve = ApprovalOperator(task_id="approve", subject="s")
        approve >> EmptyOperator(task_id="next") >> EmptyOperator(task_id="later")
    ti = TI()
    context: Any = {"ti": ti}
    assert approve.execute_complete(context, {"chosen_options": ["Approve"]})
    assert ti.skip_task_ids == set()
    approve.execute_complete(context, {"chosen_options": ["Reject"]})
    assert ti.skip_task_ids == {"next"}  # the trigger rules carry it further


def test_deadlines_count_from_their_reference() -> None:
    queued, logical = T0 + dt.timedelta(hours=1), T0
    minute = dt.timedelta(minutes=1)
    assert (
        DeadlineAlert(DeadlineReference.DAGRUN_QUEUED_AT, minute).deadline(queued, logical)
        == queued + minute
    )
    assert (
        DeadlineAlert(DeadlineReference.DAGRUN_LOGICAL_DATE, minute).deadline(queued, logical)
        == logical + minute
    )
    fixed = DeadlineReference.FIXED_DATETIME(T0 + dt.timedelta(days=1))
    assert DeadlineAlert(fixed, minute).deadline(queued, logical) == T0 + dt.timedelta(
        days=1, minutes=1
    )


def test_a_bad_deadline_is_refused_naming_the_dag() -> None:
    with pytest.raises(DagDefinitionError, match="DAG 'd': deadline must be a DeadlineAlert"):
        DAG("d", deadline=dt.timedelta(hours=1))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="interval must be a timedelta"):
        DeadlineAlert(DeadlineReference.DAGRUN_QUEUED_AT, 60)  # type: ignore[arg-type]


def test_sync_and_async_callbacks_get_their_kwargs_and_the_context() -> None:
    seen: list[Any] = []

    def sync(who: str, context: dict[str, Any]) -> None:
        seen.append((who, context["run_id"]))

    async def later(who: str) -> None:
        seen.append(who)

    minute = dt.timedelta(minutes=1)
    run_callback(
        DeadlineAlert(DeadlineReference.DAGRUN_QUEUED_AT, minute, SyncCallback(sync, {"who": "s"})),
        {"run_id": "r"},
    )
    run_callback(
        DeadlineAlert(
            DeadlineReference.DAGRUN_QUEUED_AT, minute, AsyncCallback(later, {"who": "a"})
        ),
        {"run_id": "r"},
    )
    assert seen == [("s", "r"), "a"]


def test_sla_is_deprecated_and_maps_to_a_deadline() -> None:
    def missed(context: dict[str, Any]) -> None: ...

    with pytest.warns(DeprecationWarning, match="sla_miss_callback"):
        dag = DAG("old", sla_miss_callback=missed)
    with dag, pytest.warns(DeprecationWarning, match="sla: SLAs are deprecated"):
        EmptyOperator(task_id="a", sla=dt.timedelta(hours=2))
        EmptyOperator(task_id="b", sla=dt.timedelta(hours=1))
    [alert] = dag.deadline_alerts()
    assert alert.reference is DeadlineReference.DAGRUN_QUEUED_AT
    assert alert.interval == dt.timedelta(hours=1) and alert.callback is missed
    with DAG("bad"), pytest.raises(DagDefinitionError, match="sla must be a timedelta"):
        EmptyOperator(task_id="a", sla=60)
