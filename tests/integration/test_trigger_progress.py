"""Progress a trigger reports before its event (``TriggerProgress``, issue 33): carried on the
events stream, recorded by the scheduler (the last few per try), shown by ``tasks explain``
and the task page; only the final event resumes the task."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import anyio
from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker
from starlette.testclient import TestClient

from broker.client import Broker
from broker.streams import progress_message
from deferral.runtime import metrics
from deferral.runtime.config import Settings
from deferral.runtime.crypto import Cipher
from deferral.store import progress
from deferral.store.tables import DagRun, TaskInstance, TaskStateChange
from deferral.triggers import TriggerEvent, TriggerProgress
from deferral.triggers.base import BaseTrigger, classpath_of
from readmodel.explain import explain
from scheduler.service import SchedulerService
from tests.integration.factories import DAG_ID, deferred_task
from tests.servers import REDIS_URL
from triggerer.events import carried_json, first_event
from webserver.app import create_app


class Steps(BaseTrigger):
    """Reports ``steps`` steps, then fires."""

    def __init__(self, steps: int) -> None:
        super().__init__()
        self.steps = steps

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return classpath_of(Steps), {"steps": self.steps}

    async def run(self) -> AsyncIterator[TriggerEvent | TriggerProgress]:
        for step in range(1, self.steps + 1):
            yield TriggerProgress({"step": step, "of": self.steps})
        yield TriggerEvent({"done": self.steps})


def _run(cipher: Cipher, broker: Broker, trigger_id: int, steps: int) -> None:
    """What a triggerer does with the trigger: each report, then the event, on the trigger's
    events stream in that order."""
    stream = broker.keys.events_for(trigger_id)

    def report(payload: Any) -> None:
        message = progress_message(cipher, trigger_id, carried_json(payload).decode(), "t1")
        broker.publish(stream, message)

    outcome = anyio.run(first_event, cipher, "t1", Steps(steps), trigger_id, {}, report)
    assert outcome.failure is None
    broker.publish(stream, outcome.message)


def _resumes(sessions: sessionmaker[Session], ti_id: int) -> int:
    with sessions() as session:
        return (
            session.scalar(
                select(func.count()).where(
                    TaskStateChange.task_instance_id == ti_id,
                    TaskStateChange.from_state == "deferred",
                    TaskStateChange.to_state == "scheduled",
                )
            )
            or 0
        )


def test_five_reports_then_the_event_are_recorded_and_shown_and_resume_once(
    settings: Settings, sessions: sessionmaker[Session], cipher: Cipher, broker: Broker
) -> None:
    five, _ = deferred_task(sessions, cipher, task_id="five")
    many, _ = deferred_task(sessions, cipher, task_id="many", run_id="r2")
    with sessions() as session:
        triggers = {
            ti.id: ti.trigger_id
            for ti in session.scalars(select(TaskInstance).where(TaskInstance.id.in_([five, many])))
        }
    _run(cipher, broker, triggers[five], 5)
    _run(cipher, broker, triggers[many], progress.KEPT + 5)
    service = SchedulerService(settings, name="s")
    service.attach(Broker.from_url(REDIS_URL, settings.stream_prefix))
    service.consumer.start()
    before = metrics.TRIGGER_PROGRESS._value.get()
    try:
        while service.events.apply(block_ms=None):
            pass
    finally:
        service.broker.close()
        service.engine.dispose()
    assert metrics.TRIGGER_PROGRESS._value.get() - before == 5 + progress.KEPT + 5
    assert _resumes(sessions, five) == 1 and _resumes(sessions, many) == 1
    with sessions() as session:
        reports = progress.of_try(session, cipher, five, 1)
        assert [r.payload for r in reports.kept] == [{"step": s, "of": 5} for s in range(1, 6)]
        assert reports.dropped == 0
        bounded = progress.of_try(session, cipher, many, 1)
        assert [r.seq for r in bounded.kept] == list(range(6, progress.KEPT + 6))
        assert bounded.dropped == 5
        ti = session.get(TaskInstance, five)
        assert ti is not None and ti.state in ("scheduled", "queued")
        run = session.scalars(select(DagRun).where(DagRun.run_id == "r1")).one()
        lines = explain(session, settings, None, run, ti)
    shown = [line.strip() for line in lines if "progress" in line or line.strip().startswith("#")]
    assert shown[0] == "progress reported by its trigger: 5"
    assert [line.split(": ", 1)[1] for line in shown[1:]] == [
        f'{{"of":5,"step":{s}}}' for s in range(1, 6)
    ]
    app = create_app(settings, host="127.0.0.1", environ={})
    with TestClient(app, base_url="http://localhost") as web:
        query = {"run_id": "r1", "task_id": "five"}
        page = web.get(f"/dags/{DAG_ID}/task_instance", params=query)
        answer = web.get(f"/api/v1/dags/{DAG_ID}/task_instance", params=query)
    assert page.status_code == answer.status_code == 200
    assert 'id="progress"' in page.text and "5 report(s) from its trigger" in page.text
    assert answer.json()["progress"]["total"] == 5
    assert [r["payload"] for r in answer.json()["progress"]["reports"]] == [
        f'{{"of":5,"step":{s}}}' for s in range(1, 6)
    ]
