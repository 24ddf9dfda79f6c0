"""No stuck trigger (issue 14): whatever escapes a trigger's run ends in a failure event that
retires its entry, and a run() that is not an async generator fails its task saying so."""

from __future__ import annotations

import datetime as dt
import warnings
from collections.abc import AsyncIterator, Callable
from typing import Any

import anyio
import pytest
from sqlalchemy import func, select
from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import Session, sessionmaker

from broker.client import Broker
from broker.replies import Entry
from broker.streams import GROUP_TRIGGERERS, TriggerSpec, read_event, trigger_message
from deferral.runtime import serialization
from deferral.runtime.config import Settings
from deferral.runtime.crypto import Cipher
from deferral.runtime.serialization import check_kwargs
from deferral.store import tasklogs
from deferral.store.tables import Trigger
from deferral.store.tasklogs import SOURCE_TRIGGERER, NewLine
from deferral.triggers import BaseTrigger, TriggerEvent
from tests.integration.factories import deferred_task
from triggerer.decode import Decoded
from triggerer.events import Outcome, first_event
from triggerer.service import Held, TriggererService


class Fires(BaseTrigger):
    def serialize(self) -> tuple[str, dict[str, Any]]:
        return "tests.integration.test_triggerer_outcomes.Fires", {}

    async def run(self) -> AsyncIterator[TriggerEvent]:
        yield TriggerEvent("done")


class CoroutineRun(BaseTrigger):
    def serialize(self) -> tuple[str, dict[str, Any]]:
        return "tests.integration.test_triggerer_outcomes.CoroutineRun", {}

    async def run(self) -> TriggerEvent:  # type: ignore[override]  # the mistake under test
        return TriggerEvent("never")


class ListRun(BaseTrigger):
    def serialize(self) -> tuple[str, dict[str, Any]]:
        return "tests.integration.test_triggerer_outcomes.ListRun", {}

    def run(self) -> list[TriggerEvent]:  # type: ignore[override]  # the mistake under test
        return [TriggerEvent("never")]


def _failure_text(outcome: Outcome) -> str:
    assert outcome.failure is not None, outcome
    return outcome.failure.message


@pytest.mark.parametrize(
    ("trigger", "said"),
    [
        (CoroutineRun(), "run() is a coroutine (async def without yield)"),
        (ListRun(), "run() returned list"),
    ],
)
def test_a_run_that_is_not_an_async_generator_fails_saying_so(
    settings: Settings, trigger: BaseTrigger, said: str
) -> None:
    held = Held(7, Entry("s", "1-0", {}), None, "d.r.t", 1, 1)
    cipher = Cipher(settings.fernet_keys)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "coroutine ... was never awaited" would be one
        outcome = anyio.run(first_event, cipher, "t1", trigger, held.trigger_id, held.log_ids())
    assert _failure_text(outcome) == (
        f"trigger 7 {said}: it must be an async generator that yields TriggerEvent"
    )


def test_an_unexpected_error_around_a_trigger_fails_its_task_and_retires_its_entry(
    settings: Settings,
    broker: Broker,
    cipher: Cipher,
    sessions: sessionmaker[Session],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    ti_id, trigger_id = deferred_task(sessions, cipher)
    stream = broker.keys.triggers
    broker.ensure_group(stream, GROUP_TRIGGERERS)
    classpath = "tests.integration.test_triggerer_outcomes.Fires"
    broker.publish(
        stream,
        trigger_message(
            cipher,
            trigger_id=trigger_id,
            classpath=classpath,
            kwargs=check_kwargs({}),
            task_instance_id=ti_id,
            try_number=1,
            task="d.r.t",
        ),
    )
    service = TriggererService(settings, capacity=10, name="t1")
    service.attach(broker)
    [delivery] = service.consumer.poll(1)
    spec = TriggerSpec(trigger_id, classpath, {}, ti_id, "d.r.t", 1)

    # The first attempt to queue the event fails (as any bug in the triggerer's own code could).
    send: Callable[[Held, Outcome], None] = service.publisher.send
    calls: list[Outcome] = []

    def send_failing_once(held: Held, outcome: Outcome) -> None:
        calls.append(outcome)
        if len(calls) == 1:
            raise RuntimeError("queueing broke")
        send(held, outcome)

    monkeypatch.setattr(service.publisher, "send", send_failing_once)

    async def run() -> None:
        held = Held(trigger_id, delivery.entry, anyio.CancelScope(), "d.r.t", ti_id, 1)
        service.held[trigger_id] = held
        await service.runner.run(held, Decoded(spec, Fires()))
        await service.publisher.flush()

    anyio.run(run)
    [(_, flat)] = broker.redis.xrange(broker.keys.events)
    event = read_event(cipher, dict(zip(flat[::2], flat[1::2], strict=True)))
    assert event.failed
    message = serialization.loads(event.payload)["message"]
    assert message == f"trigger {trigger_id} failed unexpectedly with RuntimeError: queueing broke"
    # The entry is retired with the failure: nothing left pending, nothing renewed here.
    assert broker.redis.xlen(stream) == 0
    assert broker.redis.execute_command("XPENDING", stream, GROUP_TRIGGERERS)[0] == 0
    assert not service.consumer.held and trigger_id not in service.held


def test_the_runner_of_started_triggers_is_written_with_the_next_task_log_lines(
    settings: Settings, sessions: sessionmaker[Session], cipher: Cipher
) -> None:
    ti_id, trigger_id = deferred_task(sessions, cipher)
    gone = trigger_id + 1000  # fired and deleted before the batch: nothing to write
    service = TriggererService(settings, capacity=10, name="t1")
    service.task_logs.owned = [trigger_id, gone]
    line = NewLine(ti_id, 1, dt.datetime.now(dt.UTC), SOURCE_TRIGGERER, "trigger started")
    service.task_logs.handler._queued.append(line)

    anyio.run(service.task_logs.store_all)

    assert service.task_logs.owned == []
    with sessions() as session:
        assert session.get_one(Trigger, trigger_id).triggerer_id == "t1"
        assert [ln.text for ln in tasklogs.read_lines(session, ti_id, 1)] == ["trigger started"]
        rows = session.scalar(select(func.count()).select_from(Trigger))
    assert rows == 1


def test_the_runner_of_started_triggers_is_kept_while_postgres_fails(
    settings: Settings, cipher: Cipher, monkeypatch: pytest.MonkeyPatch
) -> None:
    service = TriggererService(settings, capacity=10, name="t1")
    service.task_logs.owned = [3, 4]

    def down(*args: Any) -> None:
        raise OperationalError("UPDATE trigger", {}, Exception("server closed the connection"))

    monkeypatch.setattr(service.task_logs, "_store_lines", down)
    service.task_logs.owned.append(5)  # started meanwhile
    anyio.run(service.task_logs.store_all)
    assert service.task_logs.owned == [3, 4, 5]
