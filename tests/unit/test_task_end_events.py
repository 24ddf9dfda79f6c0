"""Task-end events and StartTriggerArgs (issue 18): Airflow's names and fields, the event kinds
they travel as, and a clear error for each bad input."""

from __future__ import annotations

import datetime as dt

import anyio
import pytest

from deferral.triggers import (
    DateTimeTrigger,
    StartTriggerArgs,
    TaskFailedEvent,
    TaskSkippedEvent,
    TaskSuccessEvent,
    TimeDeltaTrigger,
    TriggerEvent,
)
from deferral.triggers.task_end import MAX_END_XCOMS, check_end_xcoms, end_kind, start_trigger


def test_each_end_event_has_its_kind_and_carries_its_xcoms() -> None:
    assert end_kind(TaskSuccessEvent(xcoms={"a": 1})) == "task_success"
    assert end_kind(TaskFailedEvent()) == "task_failed"
    assert end_kind(TaskSkippedEvent()) == "task_skipped"
    assert end_kind(TriggerEvent({"xcoms": {}})) is None
    assert TaskSuccessEvent(xcoms={"a": 1}).payload == {"xcoms": {"a": 1}}
    assert check_end_xcoms(TaskFailedEvent().payload) == {}


@pytest.mark.parametrize(
    ("payload", "said"),
    [
        ("text", "must be {'xcoms'"),
        ({"xcoms": [1]}, "must be {'xcoms'"),
        ({"xcoms": {str(i): i for i in range(MAX_END_XCOMS + 1)}}, "more than"),
        ({"xcoms": {"": 1}}, "XCom key ''"),
        ({"xcoms": {"k" * 600: 1}}, "must be a string of 1..512"),
    ],
)
def test_a_bad_task_end_payload_is_refused_saying_why(payload: object, said: str) -> None:
    with pytest.raises(ValueError, match=None) as raised:
        check_end_xcoms(payload)
    assert said in str(raised.value)


def test_start_trigger_args_keep_airflows_field_order_and_build_the_trigger() -> None:
    moment = dt.datetime(2030, 1, 1, tzinfo=dt.UTC)
    args = StartTriggerArgs(
        "deferral.triggers.temporal.DateTimeTrigger", "done", {"moment": moment}
    )
    assert (args.next_method, args.next_kwargs, args.timeout) == ("done", None, None)
    trigger = start_trigger(args)
    assert isinstance(trigger, DateTimeTrigger) and trigger.moment == moment


@pytest.mark.parametrize(
    ("trigger_cls", "said"),
    [
        ("deferral.triggers.temporal.Nope", "is not a BaseTrigger class"),
        ("no_such_module_x.Trigger", "No module named"),
        ("datetime.datetime", "is not a BaseTrigger class"),
        ("Bare", "is not a BaseTrigger class"),
    ],
)
def test_a_start_trigger_that_names_no_trigger_class_is_refused(
    trigger_cls: str, said: str
) -> None:
    with pytest.raises(TypeError) as raised:
        start_trigger(StartTriggerArgs(trigger_cls, "done"))
    assert said in str(raised.value) and trigger_cls in str(raised.value)


def test_time_triggers_are_shared_and_a_time_delta_shares_at_its_absolute_moment() -> None:
    assert DateTimeTrigger.shared and TimeDeltaTrigger.shared
    delta = TimeDeltaTrigger(dt.timedelta(hours=1))
    # It serializes its absolute moment, under its own class (issue 35): two share it only at
    # the same moment.
    assert delta.serialize()[1] == DateTimeTrigger(delta.moment).serialize()[1]
    assert delta.serialize() == TimeDeltaTrigger(moment=delta.moment).serialize()


def test_a_date_time_trigger_that_ends_its_task_yields_a_success_event() -> None:
    moment = dt.datetime(2020, 1, 1, tzinfo=dt.UTC)
    ending = DateTimeTrigger(moment, end_from_trigger=True)
    assert ending.serialize()[1] == {"moment": moment, "end_from_trigger": True}
    assert ending.fires_at() is None  # run() runs: the shared timer only fires plain events
    assert DateTimeTrigger(moment).serialize()[1] == {"moment": moment}

    async def first() -> TriggerEvent:
        return await anext(aiter(ending.run()))

    assert isinstance(anyio.run(first), TaskSuccessEvent)
