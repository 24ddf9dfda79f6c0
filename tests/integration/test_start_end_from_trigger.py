"""start_from_trigger and end_from_trigger (issue 18): a task whose pool has no free slot is
deferred by the scheduler and resumes; a trigger's TaskSuccessEvent / TaskSkippedEvent /
TaskFailedEvent ends its task (with XComs; a failure retries while tries are left) without any
worker attempt, as task_state_change shows."""

from __future__ import annotations

import datetime as dt
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import anyio
import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from broker import streams
from broker.client import Broker
from broker.streams import GROUP_TRIGGERERS
from deferral.runtime.config import Settings
from deferral.runtime.crypto import Cipher, Purpose
from deferral.states import FAIL_METHOD
from deferral.store import transitions
from deferral.store.tables import Pool, TaskInstance, TaskStateChange, XCom
from deferral.triggers import (
    BaseTrigger,
    TaskFailedEvent,
    TaskSkippedEvent,
    TaskSuccessEvent,
    TriggerEvent,
)
from scheduler.service import SchedulerService
from tests.helpers import wait_for
from tests.integration.factories import deferred_task
from tests.servers import REDIS_URL
from triggerer.decode import decode_entry
from triggerer.events import first_event

HERE = "tests.integration.test_start_end_from_trigger"


class EndingTrigger(BaseTrigger):
    """Fires at once: a task-end event of ``outcome``, or a plain event for "resume"."""

    def __init__(self, outcome: str) -> None:
        super().__init__()
        self.outcome = outcome

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return f"{HERE}.EndingTrigger", {"outcome": self.outcome}

    async def run(self) -> AsyncIterator[TriggerEvent]:
        xcoms = {"rows": 3}
        if self.outcome == "success":
            yield TaskSuccessEvent(xcoms=xcoms)
        elif self.outcome == "skipped":
            yield TaskSkippedEvent()
        elif self.outcome == "failed":
            yield TaskFailedEvent(xcoms=xcoms)
        else:
            yield TriggerEvent({"resumed": True})


DAG_SOURCE = """
import pathlib

from deferral import DAG
from deferral.models import BaseOperator
from deferral.triggers import StartTriggerArgs


class StartsInTriggerer(BaseOperator):
    start_from_trigger = True

    def __init__(self, outcome, **kwargs):
        super().__init__(**kwargs)
        self.start_trigger_args = StartTriggerArgs(
            trigger_cls="{here}.EndingTrigger",
            next_method="execute_complete",
            trigger_kwargs={{"outcome": outcome}},
            next_kwargs={{"n": 1}},
        )

    def execute(self, context):
        raise AssertionError("execute must not run: the task starts in the triggerer")

    def execute_complete(self, context, event, n):
        return event


def called(name):
    def callback(context):
        with open(pathlib.Path({marks!r}) / name, "w") as out:
            out.write(f"{{context['ti'].task_id}} try {{context['try_number']}}")
    return callback


with DAG("{dag_id}") as dag:
    StartsInTriggerer(
        task_id="t",
        outcome="{outcome}",
        pool="small",
        retries={retries},
        on_success_callback=called("success"),
        on_failure_callback=called("failed"),
        on_retry_callback=called("up_for_retry"),
        on_skipped_callback=called("skipped"),
    )
"""


def _changes(sessions: sessionmaker[Session]) -> list[tuple[str, str]]:
    with sessions() as session:
        rows = session.execute(
            select(TaskStateChange.from_state, TaskStateChange.to_state).order_by(
                TaskStateChange.id
            )
        )
        return [(r.from_state, r.to_state) for r in rows]


def _fire_the_trigger(settings: Settings, cipher: Cipher, broker: Broker) -> None:
    """What a triggerer does with the one trigger entry: decode it, run the trigger to its
    first event, publish that."""
    broker.ensure_group(broker.keys.triggers, GROUP_TRIGGERERS)
    (entry,) = broker.read(GROUP_TRIGGERERS, "t1", {broker.keys.triggers: ">"}, count=10)
    decoded = decode_entry(entry, cipher, (*settings.trigger_modules, HERE))
    outcome = anyio.run(first_event, cipher, "t1", decoded.trigger, decoded.spec.trigger_id, {})
    broker.publish(broker.keys.events, outcome.message)


def _run_and_dispatch(
    settings: Settings, sessions: sessionmaker[Session], dag_id: str
) -> SchedulerService:
    """A run of ``dag_id`` (its task's pool has no free slot), scheduled and dispatched by a
    scheduler's passes; that scheduler."""
    with sessions.begin() as session:
        session.merge(Pool(name="small", slots=0, include_deferred=False))
        transitions.create_dag_run(session, dag_id, "r1", dt.datetime.now(dt.UTC), {})
    service = SchedulerService(settings, name="s")
    service.attach(Broker.from_url(REDIS_URL, settings.stream_prefix))
    service.consumer.start()
    service.refresh_dags()  # a running scheduler reads the folder off its loop
    service.start_queued_runs()
    service.evaluate_marked_runs()
    service.dispatch_scheduled()
    return service


@pytest.mark.parametrize(
    ("outcome", "retries", "ended"),
    [
        ("success", 0, "success"),
        ("skipped", 0, "skipped"),
        ("failed", 1, "up_for_retry"),
        ("failed", 0, "failed"),
        ("resume", 0, "scheduled"),
    ],
)
def test_a_task_starts_in_the_triggerer_with_no_free_slot_and_ends_there(
    settings: Settings,
    sessions: sessionmaker[Session],
    cipher: Cipher,
    broker: Broker,
    write_dag: Callable[[str, str], Path],
    outcome: str,
    retries: int,
    ended: str,
    tmp_path: Path,
) -> None:
    dag_id = f"sft_{uuid.uuid4().hex[:8]}"
    marks = tmp_path / "called"
    marks.mkdir()
    source = DAG_SOURCE.format(
        here=HERE, dag_id=dag_id, outcome=outcome, retries=retries, marks=str(marks)
    )
    write_dag(dag_id, source)
    service = _run_and_dispatch(settings, sessions, dag_id)
    assert _changes(sessions) == [("none", "scheduled"), ("scheduled", "deferred")]
    assert broker.redis.xlen(broker.keys.queue("default")) == 0

    _fire_the_trigger(settings, cipher, broker)
    while service.events.apply(block_ms=None):
        pass
    service.dispatch_scheduled()  # the pool is full: a resumed task stays scheduled

    # No queued or running step: no worker attempt, not even a second one.
    assert _changes(sessions) == [
        ("none", "scheduled"),
        ("scheduled", "deferred"),
        ("deferred", ended),
    ]
    with sessions() as session:
        ti = session.scalars(select(TaskInstance)).one()
        xcoms = {x.key: x.value for x in session.scalars(select(XCom))}
    assert ti.try_number == 1 and ti.trigger_id is None
    if outcome in ("success", "failed"):
        assert xcoms == {"rows": 3}
    if outcome == "resume":
        assert ti.next_method == "execute_complete"
        assert cipher.open(Purpose.RESUME_KWARGS, ti.next_kwargs or "") == {"n": 1}
        return
    # The task's callback of the state it ended in ran (in the scheduler), once.
    mark = marks / ended
    assert wait_for(mark.exists, what=f"the {ended} callback")
    assert mark.read_text() == "t try 1"
    service.callbacks.shutdown(wait=True)
    assert [p.name for p in marks.iterdir()] == [ended]


def test_a_task_that_starts_in_the_triggerer_sends_its_trigger_to_its_queue(
    settings: Settings,
    sessions: sessionmaker[Session],
    broker: Broker,
    write_dag: Callable[[str, str], Path],
    tmp_path: Path,
) -> None:
    dag_id = f"sft_{uuid.uuid4().hex[:8]}"
    source = DAG_SOURCE.format(
        here=HERE, dag_id=dag_id, outcome="success", retries=0, marks=str(tmp_path)
    )
    write_dag(dag_id, source.replace('pool="small",', 'pool="small",\n        queue="gpu",'))
    _run_and_dispatch(settings, sessions, dag_id)
    with sessions() as session:
        trigger_id = session.scalars(select(TaskInstance.trigger_id)).one()
    assert trigger_id is not None
    assert broker.redis.xlen(broker.keys.trigger_stream("gpu", trigger_id)) == 1
    assert broker.redis.xlen(broker.keys.triggers) == 0


def test_a_task_end_event_with_a_bad_payload_fails_its_task_saying_why(
    settings: Settings, sessions: sessionmaker[Session], cipher: Cipher, broker: Broker
) -> None:
    ti_id, trigger_id = deferred_task(sessions, cipher)
    service = SchedulerService(settings, name="s")
    service.attach(Broker.from_url(REDIS_URL, settings.stream_prefix))
    service.consumer.start()
    message = streams.event_message(
        cipher, trigger_id, f"{trigger_id}:bad", "task_success", '"not xcoms"', "t1"
    )
    broker.publish(broker.keys.events, message)
    while service.events.apply(block_ms=None):
        pass
    with sessions() as session:
        ti = session.get(TaskInstance, ti_id)
        assert ti is not None and ti.next_method == FAIL_METHOD
        said = cipher.open(Purpose.RESUME_KWARGS, ti.next_kwargs or "")
    assert said["message"] == (
        f"trigger {trigger_id} sent a bad task-end event: a task-end event's payload must be"
        " {'xcoms': {key: value}}"
    )
