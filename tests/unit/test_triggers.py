"""deferral.triggers: built-in triggers, their serialized form and their run()."""

from __future__ import annotations

import datetime as dt
import importlib
from pathlib import Path
from typing import Any
from zoneinfo import ZoneInfo

import anyio
import pytest

from deferral.runtime import serialization
from deferral.triggers import (
    BaseTrigger,
    DateTimeTrigger,
    FileTrigger,
    TimeDeltaTrigger,
    TriggerEvent,
)
from deferral.triggers.base import classpath_of


async def collect(trigger: BaseTrigger, limit: float = 5.0) -> list[TriggerEvent]:
    events: list[TriggerEvent] = []
    with anyio.fail_after(limit):
        async for event in trigger.run():
            events.append(event)
    return events


def rebuild(trigger: BaseTrigger) -> BaseTrigger:
    """What the triggerer does: import the classpath and call it with the kwargs, after the
    kwargs went through the JSON form."""
    classpath, kwargs = trigger.serialize()
    module_name, _, class_name = classpath.rpartition(".")
    cls = getattr(importlib.import_module(module_name), class_name)
    return cls(**serialization.loads(serialization.dumps(kwargs)))


# -- DateTimeTrigger -------------------------------------------------------------------------------


def test_datetime_trigger_serializes_its_moment() -> None:
    moment = dt.datetime(2030, 1, 1, 8, 0, tzinfo=ZoneInfo("Asia/Tokyo"))
    trigger = DateTimeTrigger(moment)
    assert trigger.serialize() == ("deferral.triggers.temporal.DateTimeTrigger", {"moment": moment})
    again = rebuild(trigger)
    assert isinstance(again, DateTimeTrigger)
    assert again.moment == moment
    assert again.serialize() == trigger.serialize()


def test_datetime_trigger_in_the_past_fires_once_with_its_moment() -> None:
    moment = dt.datetime(2000, 1, 1, tzinfo=dt.UTC)
    events = anyio.run(collect, DateTimeTrigger(moment))
    assert events == [TriggerEvent(moment)]
    assert events[0].payload == moment


def test_datetime_trigger_shortly_in_the_future_waits_then_fires() -> None:
    moment = dt.datetime.now(dt.UTC) + dt.timedelta(milliseconds=150)
    events = anyio.run(collect, DateTimeTrigger(moment))
    assert dt.datetime.now(dt.UTC) >= moment
    assert events == [TriggerEvent(moment)]


@pytest.mark.parametrize("bad", ["2030-01-01T00:00:00+00:00", 1893456000, dt.date(2030, 1, 1)])
def test_datetime_trigger_refuses_non_datetime(bad: Any) -> None:
    with pytest.raises(TypeError, match="moment must be a datetime"):
        DateTimeTrigger(bad)


def test_datetime_trigger_refuses_naive_datetime() -> None:
    with pytest.raises(ValueError, match="tz-aware"):
        DateTimeTrigger(dt.datetime(2030, 1, 1))


# -- TimeDeltaTrigger ------------------------------------------------------------------------------


def test_time_delta_trigger_serializes_its_own_class_at_the_absolute_moment() -> None:
    before = dt.datetime.now(dt.UTC)
    trigger = TimeDeltaTrigger(dt.timedelta(hours=1))
    after = dt.datetime.now(dt.UTC)
    classpath, kwargs = trigger.serialize()
    assert classpath == "deferral.triggers.temporal.TimeDeltaTrigger"
    assert set(kwargs) == {"moment"}
    moment = kwargs["moment"]
    assert isinstance(moment, dt.datetime)
    assert moment.utcoffset() is not None
    assert before + dt.timedelta(hours=1) <= moment <= after + dt.timedelta(hours=1)


def test_time_delta_trigger_serialize_is_deterministic_and_rebuild_keeps_moment() -> None:
    trigger = TimeDeltaTrigger(dt.timedelta(minutes=10))
    first = trigger.serialize()
    assert trigger.serialize() == first
    assert serialization.dumps(first[1]) == serialization.dumps(trigger.serialize()[1])
    again = rebuild(trigger)
    assert type(again) is TimeDeltaTrigger
    assert again.serialize() == first
    assert again.fires_at() == trigger.moment  # still a plain timer in the triggerer


def test_time_delta_trigger_takes_a_delta_or_a_moment_not_both() -> None:
    moment = dt.datetime(2030, 1, 1, tzinfo=dt.UTC)
    assert TimeDeltaTrigger(moment=moment).moment == moment
    with pytest.raises(TypeError, match="either delta or moment"):
        TimeDeltaTrigger(dt.timedelta(1), moment=moment)


def test_time_delta_trigger_negative_delta_fires_at_once() -> None:
    events = anyio.run(collect, TimeDeltaTrigger(dt.timedelta(seconds=-5)))
    assert len(events) == 1
    assert events[0].payload <= dt.datetime.now(dt.UTC)


@pytest.mark.parametrize("bad", [60, 1.5, "PT1H", None])
def test_time_delta_trigger_refuses_non_timedelta(bad: Any) -> None:
    with pytest.raises(TypeError, match="delta must be a timedelta"):
        TimeDeltaTrigger(bad)


# -- FileTrigger -----------------------------------------------------------------------------------


def test_file_trigger_fires_when_file_exists(tmp_path: Path) -> None:
    target = tmp_path / "ready.flag"
    target.write_text("")
    events = anyio.run(collect, FileTrigger(str(target), poll_interval=0.01))
    assert events == [TriggerEvent({"found": True})]


def test_file_trigger_waits_for_file_to_appear(tmp_path: Path) -> None:
    target = tmp_path / "later.flag"

    async def scenario() -> tuple[list[TriggerEvent], bool]:
        events: list[TriggerEvent] = []
        existed_when_fired = False

        async def run() -> None:
            nonlocal existed_when_fired
            events.extend(await collect(FileTrigger(str(target), poll_interval=0.01)))
            existed_when_fired = target.exists()

        async with anyio.create_task_group() as tg:
            tg.start_soon(run)
            await anyio.sleep(0.1)
            assert events == []  # still waiting
            target.write_text("now")
        return events, existed_when_fired

    events, existed = anyio.run(scenario)
    assert existed
    assert events == [TriggerEvent({"found": True})]


def test_file_trigger_serialize_round_trip(tmp_path: Path) -> None:
    trigger = FileTrigger(str(tmp_path / "x"), poll_interval=0.5)
    assert trigger.serialize() == (
        "deferral.triggers.file.FileTrigger",
        {"filepath": str(tmp_path / "x"), "poll_interval": 0.5, "recursive": False},
    )
    again = rebuild(trigger)
    assert again.serialize() == trigger.serialize()


def test_file_trigger_default_poll_interval() -> None:
    assert FileTrigger("/tmp/x").serialize()[1]["poll_interval"] == 5.0


@pytest.mark.parametrize(
    ("args", "kwargs"),
    [((0,), {}), ((None,), {}), (("/tmp/x",), {"poll_interval": "5"})],
)
def test_file_trigger_refuses_wrong_argument_types(
    args: tuple[Any, ...], kwargs: dict[str, Any]
) -> None:
    with pytest.raises((TypeError, ValueError)):
        FileTrigger(*args, **kwargs)


# -- base ------------------------------------------------------------------------------------------


def test_trigger_event_equality_and_repr() -> None:
    assert TriggerEvent({"a": 1}) == TriggerEvent({"a": 1})
    assert TriggerEvent({"a": 1}) != TriggerEvent({"a": 2})
    assert TriggerEvent(1) != 1
    assert hash(TriggerEvent("x")) == hash(TriggerEvent("x"))
    assert repr(TriggerEvent("x")) == "TriggerEvent('x')"


def test_base_trigger_is_abstract() -> None:
    with pytest.raises(TypeError):
        BaseTrigger()  # type: ignore[abstract]


def test_base_trigger_default_hooks_and_trigger_id() -> None:
    trigger = DateTimeTrigger(dt.datetime(2000, 1, 1, tzinfo=dt.UTC))
    assert trigger.trigger_id is None
    anyio.run(trigger.cleanup)
    anyio.run(trigger.on_kill)
    assert "deferral.triggers.temporal.DateTimeTrigger" in repr(trigger)
    assert "moment" in repr(trigger)


def test_classpath_of() -> None:
    assert classpath_of(FileTrigger) == "deferral.triggers.file.FileTrigger"


def test_only_a_plain_wait_for_a_moment_runs_on_the_shared_timer() -> None:
    import datetime as dt

    from deferral.triggers import DateTimeTrigger, HttpTrigger, TimeDeltaTrigger

    moment = dt.datetime(2030, 1, 1, tzinfo=dt.UTC)
    assert DateTimeTrigger(moment).fires_at() == moment
    assert TimeDeltaTrigger(dt.timedelta(hours=1)).fires_at() is not None

    class Chatty(DateTimeTrigger):
        async def run(self):  # type: ignore[override]
            yield None

    class Cleans(DateTimeTrigger):
        async def cleanup(self) -> None:
            pass

    assert Chatty(moment).fires_at() is None
    assert Cleans(moment).fires_at() is None
    assert HttpTrigger("http://example.invalid/").fires_at() is None
