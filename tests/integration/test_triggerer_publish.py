"""A fired trigger's lines for its try's log travel with its event (the scheduler stores them
when it applies the event): publishing costs no transaction, and the lines still come before
the resumed attempt's."""

from __future__ import annotations

import datetime as dt
import logging

import anyio
from sqlalchemy.orm import Session, sessionmaker

from broker.client import Broker
from broker.streams import GROUP_TRIGGERERS, read_event, trigger_message
from deferral.runtime import serialization
from deferral.runtime.config import Settings
from deferral.runtime.crypto import Cipher
from deferral.runtime.process import log_ids
from deferral.runtime.serialization import check_kwargs
from deferral.store import tasklogs
from tests.integration.factories import DAG_ID, deferred_task, timer_message
from triggerer.events import event_outcome
from triggerer.service import Held, TriggererService


def test_a_fired_triggers_lines_travel_with_its_event(
    settings: Settings, broker: Broker, cipher: Cipher, sessions: sessionmaker[Session]
) -> None:
    ti_id, trigger_id = deferred_task(sessions, cipher)
    stream = broker.keys.triggers
    broker.ensure_group(stream, GROUP_TRIGGERERS)
    spec = trigger_message(
        cipher,
        trigger_id=trigger_id,
        classpath="deferral.triggers.temporal.DateTimeTrigger",
        kwargs=check_kwargs({}),
        task_instance_id=ti_id,
        try_number=1,
        task="d.r.t",
    )
    broker.publish(stream, spec)
    [entry] = broker.read(GROUP_TRIGGERERS, "t1", {stream: ">"}, count=1)
    service = TriggererService(settings, capacity=10, name="t1")
    service.attach(broker)
    held = Held(trigger_id, entry, None, "d.r.t", ti_id, 1)
    service.held[trigger_id] = held
    logger = logging.getLogger("deferral.triggerer")
    logger.addHandler(service.task_logs.handler)
    level = logger.level
    logger.setLevel(logging.INFO)
    try:
        logger.info("for another try", extra=log_ids(task_instance_id=ti_id + 1, try_number=1))
        service.publisher.send(held, event_outcome(cipher, trigger_id, "done", "t1"))
        anyio.run(service.publisher.flush)
    finally:
        logger.removeHandler(service.task_logs.handler)
        logger.setLevel(level)

    [(_, flat)] = broker.redis.xrange(broker.keys.events)
    event = read_event(cipher, dict(zip(flat[::2], flat[1::2], strict=True)))
    assert event.log is not None
    assert (event.log.task_instance_id, event.log.try_number) == (ti_id, 1)
    assert [text for _, text in event.log.lines] == [
        f'INFO deferral.triggerer: trigger {trigger_id} for d.r.t fired: "done"'
    ]
    with sessions() as session:
        assert tasklogs.read_lines(session, ti_id, 1) == []  # stored by whoever applies it
    assert [line.text for line in service.task_logs.handler.take()] == [
        "INFO deferral.triggerer: for another try"
    ]


def test_a_timers_event_is_sealed_near_its_moment_and_published_as_sealed(
    settings: Settings, broker: Broker, cipher: Cipher, sessions: sessionmaker[Session]
) -> None:
    ti_id, trigger_id = deferred_task(sessions, cipher)
    stream = broker.keys.triggers
    broker.ensure_group(stream, GROUP_TRIGGERERS)
    moment = dt.datetime.now(dt.UTC) + dt.timedelta(days=1)
    broker.publish(stream, timer_message(cipher, trigger_id, moment, ti_id, f"{DAG_ID}.r1.t"))
    service = TriggererService(settings, capacity=10, name="t1")
    service.attach(broker)
    service.consumer.start()

    async def hold_then_fire() -> None:
        async with anyio.create_task_group() as tasks:
            await service.starter.start_all(tasks, service.consumer.poll(1))
            tasks.cancel_scope.cancel()
        held = service.held[trigger_id]
        assert held not in service.runner.sealed  # a day before its moment: none kept
        service.runner.seal_timer(held)  # as the timers do shortly before the moment
        assert held in service.runner.sealed
        service.runner.timer_fired(held)  # as the timers do at the moment
        await service.publisher.flush()
        assert not service.runner.sealed

    anyio.run(hold_then_fire)
    built = event_outcome(cipher, trigger_id, moment, "t1").message
    [(_, flat)] = broker.redis.xrange(broker.keys.events)
    event = read_event(cipher, dict(zip(flat[::2], flat[1::2], strict=True)))
    assert event.dedup_key == built.dedup_key  # the same event as one built at the moment
    assert serialization.loads(event.payload.encode()) == moment
