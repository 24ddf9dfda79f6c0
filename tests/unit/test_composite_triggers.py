"""The authoring side of composite waits (issue 33): ``where`` filters compiled to jsonpath and
refused with one line naming the fault, ``AnyOf`` / ``AllOf`` built, serialized and rebuilt,
their one timer, and ``defer(cancel_on=)`` checked at defer time."""

from __future__ import annotations

import datetime as dt
from collections.abc import AsyncIterator
from typing import Any, ClassVar

import anyio
import pytest

from broker.streams import TriggerSpec
from deferral import signals
from deferral.exceptions import TaskDeferred
from deferral.operators import EmptyOperator
from deferral.runtime import serialization
from deferral.store import waits
from deferral.triggers import (
    AllOf,
    AnyOf,
    CallbackTrigger,
    DateTimeTrigger,
    HttpTrigger,
    SignalTrigger,
    TimeDeltaTrigger,
)
from deferral.triggers.base import BaseTrigger, TriggerEvent
from deferral.triggers.signal import SignalError, where_predicate
from triggerer.decode import RejectedEntry, _instantiate
from worker import attempt
from worker.outcomes import Deferred, Failed

MOMENT = dt.datetime(2030, 1, 1, tzinfo=dt.UTC)


@pytest.mark.parametrize(
    ("where", "predicate"),
    [
        ({"status": "paid"}, '($."status" == "paid")'),
        (
            {"status": "paid", "amount": {">=": 100}},
            '($."status" == "paid") && (($."amount" >= 100))',
        ),
        ({"customer.tier": {"!=": None}}, '(($."customer"."tier" != null))'),
        ({"n": {">": 1, "<": 2.5}}, '(($."n" > 1) && ($."n" < 2.5))'),
        ({"s": {"in": ["a", 1, True]}}, '((exists($."s" ? (@ == "a" || @ == 1 || @ == true))))'),
        ({'we"ird': 1}, '($."we\\"ird" == 1)'),
    ],
)
def test_where_compiles_to_a_jsonpath_predicate(where: dict[str, Any], predicate: str) -> None:
    assert where_predicate(where) == predicate


@pytest.mark.parametrize(
    ("where", "said"),
    [
        ({"amount": {"~": 1}}, "where: unknown operator '~' for 'amount'"),
        ({"amount": {"like": "x"}}, "where: unknown operator 'like' for 'amount'"),
        ({"amount": {">=": [1]}}, "where: '>=' of 'amount' needs a number or a string"),
        ({"amount": {">": True}}, "where: '>' of 'amount' needs a number or a string"),
        ({"s": {"in": []}}, "where: 'in' of 's' needs a non-empty list"),
        ({"s": {"in": "ab"}}, "where: 'in' of 's' needs a non-empty list"),
        ({"s": {}}, "where: field 's' has an empty condition"),
        ({"s": [1, 2]}, "where: 's' compares with list"),
        ({"s": float("nan")}, "where: 's' compares with float"),
        ({"a..b": 1}, "where: field 'a..b' is invalid"),
        ({"": 1}, "where: field '' is invalid"),
        ({}, "where must be a non-empty dict"),
        (["status"], "where must be a non-empty dict"),
    ],
)
def test_bad_where_is_one_line_naming_the_fault(where: Any, said: str) -> None:
    with pytest.raises(SignalError) as raised:
        SignalTrigger("key", where=where)
    assert str(raised.value).startswith(said)
    assert "\n" not in str(raised.value)


def test_signal_trigger_without_where_serializes_as_before() -> None:
    assert SignalTrigger("k").serialize()[1] == {"key": "k", "lookback": dt.timedelta(0)}
    assert SignalTrigger("k", where={"a": 1}).serialize()[1]["where"] == {"a": 1}


def _rebuilt(trigger: AnyOf | AllOf, prefixes: tuple[str, ...] = ("deferral", __name__)) -> Any:
    """As the triggerer builds it from its entry (``triggerer.decode``: its class and the
    nested ones checked against the allowed modules)."""
    classpath, kwargs = trigger.serialize()
    spec = TriggerSpec(5, classpath, serialization.check_kwargs(kwargs), 1, "t")
    return _instantiate(spec, list(prefixes)).trigger


def test_composites_serialize_their_named_branches_in_order() -> None:
    trigger = AnyOf(
        paid=SignalTrigger("p", where={"ok": True}),
        timeout=DateTimeTrigger(MOMENT),
    )
    rebuilt = _rebuilt(trigger)
    assert isinstance(rebuilt, AnyOf)
    assert rebuilt.serialize() == trigger.serialize()
    assert [name for name, _, _ in rebuilt.branches] == ["paid", "timeout"]
    assert rebuilt.running is None


@pytest.mark.parametrize(
    ("build", "said"),
    [
        (lambda: AnyOf(), "AnyOf needs at least one named branch"),
        (lambda: AnyOf(branches=SignalTrigger("x")), "branch name 'branches' is reserved"),
        (lambda: AnyOf(_x=SignalTrigger("x")), "branch name '_x' is invalid"),
        (lambda: AnyOf(a="x"), "branch 'a' is 'x', not a trigger"),
        (lambda: AnyOf(a=AllOf(b=SignalTrigger("x"))), "branch 'a' is a AllOf: composites do"),
        (
            lambda: AllOf(poll=HttpTrigger("http://h/x"), s=SignalTrigger("x")),
            "AllOf branch 'poll' must run in a triggerer: only an AnyOf may hold one",
        ),
        (
            lambda: AnyOf(a=HttpTrigger("http://h/x"), b=HttpTrigger("http://h/y")),
            "AnyOf branches 'a' and 'b' both must run in a triggerer: at most one may",
        ),
    ],
)
def test_bad_composites_are_one_line_naming_the_fault(build: Any, said: str) -> None:
    with pytest.raises(SignalError) as raised:
        build()
    assert str(raised.value).startswith(said)


def test_an_any_of_may_hold_one_running_branch_the_triggerer_checks() -> None:
    trigger = AnyOf(poll=HttpTrigger("http://h/x"), stop=SignalTrigger("stop"))
    assert trigger.running == "poll"
    _, kwargs = trigger.serialize()
    assert AnyOf.nested_classpaths(kwargs) == ("deferral.triggers.http.HttpTrigger",)
    assert SignalTrigger.nested_classpaths({}) == ()


def test_one_timer_the_earliest_of_an_any_of_the_latest_of_an_all_of() -> None:
    later = MOMENT + dt.timedelta(hours=1)
    for cls, expected in ((AnyOf, ("first", MOMENT)), (AllOf, ("second", later))):
        trigger = cls(
            first=DateTimeTrigger(MOMENT),
            second=TimeDeltaTrigger(moment=later),
            s=SignalTrigger("x"),
        )
        classpath, kwargs = trigger.serialize()
        assert waits.timer_of(classpath, kwargs["branches"]) == expected
    classpath, kwargs = AnyOf(s=SignalTrigger("x")).serialize()
    assert waits.timer_of(classpath, kwargs["branches"]) is None


def test_callback_branch_is_a_row_branch() -> None:
    trigger = AnyOf(cb=CallbackTrigger(token="t.1.2.3.4"))
    assert trigger.running is None


class _Task(EmptyOperator):
    pass


def test_cancel_on_is_checked_at_defer_time() -> None:
    task = _Task(task_id="t")
    with pytest.raises(TaskDeferred) as deferred:
        task.defer(
            trigger=DateTimeTrigger(MOMENT),
            method_name="execute",
            cancel_on=SignalTrigger("stop"),
            cancel_state="failed",
        )
    assert deferred.value.cancel_state == "failed"
    with pytest.raises(TypeError, match="cancel_on must be a SignalTrigger, got DateTimeTrigger"):
        task.defer(
            trigger=DateTimeTrigger(MOMENT), method_name="x", cancel_on=DateTimeTrigger(MOMENT)
        )  # type: ignore[arg-type]
    with pytest.raises(
        ValueError, match="cancel_state must be 'skipped' or 'failed', got 'success'"
    ):
        task.defer(
            trigger=DateTimeTrigger(MOMENT),
            method_name="x",
            cancel_on=SignalTrigger("stop"),
            cancel_state="success",
        )


class Ready(BaseTrigger):
    """A trigger that must run: fires at once with its value; records its hooks."""

    calls: ClassVar[list[str]] = []

    def __init__(self, value: int) -> None:
        super().__init__()
        self.value = value

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return f"{__name__}.Ready", {"value": self.value}

    async def run(self) -> AsyncIterator[TriggerEvent]:
        yield TriggerEvent(self.value)

    async def cleanup(self) -> None:
        Ready.calls.append("cleanup")

    async def on_kill(self) -> None:
        Ready.calls.append("on_kill")


def test_an_any_of_runs_its_running_branch_and_names_it_in_the_event() -> None:
    """In a triggerer (rebuilt from its kwargs, the nested class allowed), an AnyOf runs the
    branch that must run, and its event says which branch fired; on_kill reaches that branch."""
    trigger = _rebuilt(AnyOf(poll=Ready(7), stop=SignalTrigger("stop")))

    async def scenario() -> list[TriggerEvent]:
        events = [event async for event in trigger.run()]
        await trigger.on_kill()
        return events

    assert anyio.run(scenario) == [TriggerEvent({"fired": "poll", "payload": 7})]
    assert Ready.calls == ["cleanup", "on_kill"]
    with pytest.raises(RejectedEntry, match="Ready' is outside DEFERRAL_TRIGGER_MODULES"):
        _rebuilt(AnyOf(poll=Ready(7)), ("deferral",))


def test_an_any_of_with_no_running_branch_refuses_to_run() -> None:
    async def scenario() -> None:
        async for _ in AnyOf(s=SignalTrigger("x")).run():
            pass

    with pytest.raises(SignalError, match="AnyOf waits are resumed by signals"):
        anyio.run(scenario)


def test_a_task_deferred_raised_by_hand_is_checked_by_the_task_process() -> None:
    """TaskDeferred raised directly (not through defer()) with a bad cancel-on fails the
    attempt naming it, as a bad trigger does; a good one travels as the trigger's kwargs."""
    task = _Task(task_id="t")
    bad = TaskDeferred(
        trigger=DateTimeTrigger(MOMENT),
        method_name="execute",
        cancel_on=SignalTrigger("stop"),
        cancel_state="success",
    )
    failed = attempt._deferral(task, bad, None)
    assert isinstance(failed, Failed)
    assert failed.error == (
        "task 't' cannot defer: cancel_state must be 'skipped' or 'failed', got 'success'"
    )
    good = TaskDeferred(
        trigger=DateTimeTrigger(MOMENT),
        method_name="execute",
        cancel_on=SignalTrigger("stop", where={"a": 1}),
    )
    deferred = attempt._deferral(task, good, None)
    assert isinstance(deferred, Deferred)
    assert deferred.cancel_on is not None
    assert serialization.from_jsonable(deferred.cancel_on) == {
        "key": "stop",
        "lookback": dt.timedelta(0),
        "where": {"a": 1},
    }
    assert deferred.shared is False  # a time trigger, but a cancel-on is one task's


def test_a_bad_heartbeat_interval_is_refused_in_one_line() -> None:
    with pytest.raises(SignalError, match=r"^heartbeat must be a timedelta, got int$"):
        CallbackTrigger(token="t.1.2.3.4", heartbeat=30)  # type: ignore[arg-type]
    with pytest.raises(SignalError, match=r"^heartbeat 0:00:00.500000 is out of range"):
        CallbackTrigger(token="t.1.2.3.4", heartbeat=dt.timedelta(seconds=0.5))
    beating = CallbackTrigger(token="t.1.2.3.4", heartbeat=dt.timedelta(minutes=1))
    assert beating.serialize()[1] == {"token": "t.1.2.3.4", "heartbeat": dt.timedelta(minutes=1)}
    assert CallbackTrigger(token="t.1.2.3.4").serialize()[1] == {"token": "t.1.2.3.4"}


def test_a_callback_that_beats_holds_its_interval_alone_or_as_a_branch() -> None:
    token = "7.1.99999999999.nonce.sig"  # task instance 7, try 1 (its shape; not verified here)
    every = dt.timedelta(minutes=2)
    for trigger in (
        CallbackTrigger(token=token, heartbeat=every),
        AnyOf(job=CallbackTrigger(token=token, heartbeat=every), late=TimeDeltaTrigger(every)),
    ):
        classpath, kwargs = trigger.serialize()
        wait = signals.wait_of(classpath, serialization.check_kwargs(kwargs), 7, 1)
        assert wait is not None
        assert [row.heartbeat for row in wait.rows] == [every]
    plain = CallbackTrigger(token=token).serialize()
    wait = signals.wait_of(plain[0], serialization.check_kwargs(plain[1]), 7, 1)
    assert wait is not None and [row.heartbeat for row in wait.rows] == [None]
