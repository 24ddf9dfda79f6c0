"""A scheduler loop's work depends on what changed, not on how many runs merely wait: the SQL
statements of one loop that applies one fired event (and queues its task in that same loop) are
the same with 10 and with 2,000 runs whose tasks are all deferred, and a loop with nothing to do
is one statement."""

from __future__ import annotations

import datetime as dt
import time
from collections.abc import Callable
from typing import Any

import pytest
from sqlalchemy import event, select, text
from sqlalchemy.orm import Session, sessionmaker

from broker.client import Broker
from deferral.config import Settings
from deferral.crypto import Cipher
from deferral.models import TaskInstance
from scheduler import service as scheduler_service
from scheduler.service import SchedulerService
from tests.integration.factories import deferred_task
from tests.servers import REDIS_URL
from triggerer.events import event_message


def _idle_runs(sessions: sessionmaker[Session], first: int, count: int) -> None:
    """``count`` running runs (a logical date each), each with one task deferred on a
    far-future trigger, as they are after their last evaluation (not marked)."""
    with sessions.begin() as session:
        session.execute(
            text(
                """
                WITH runs AS (
                    INSERT INTO dag_run (dag_id, run_id, logical_date, state, start_date)
                    SELECT 'idle', 'idle_' || n, now() - n * interval '1 second', 'running', now()
                    FROM generate_series(:first, :first + :count - 1) AS n
                    RETURNING run_id
                ), triggers AS (
                    INSERT INTO trigger (classpath, kwargs)
                    SELECT 'deferral.triggers.temporal.DateTimeTrigger', run_id
                    FROM runs
                    RETURNING id, kwargs AS run_id
                )
                INSERT INTO task_instance (dag_id, run_id, task_id, state, try_number, trigger_id,
                                           next_method)
                SELECT 'idle', run_id, 'wait', 'deferred', 1, id, 'resume' FROM triggers
                """
            ),
            {"first": first, "count": count},
        )


def _loop_service(settings: Settings) -> SchedulerService:
    """A scheduler whose first loop (with its periodic work) has run: the next has none due."""
    service = SchedulerService(settings, name="cost")
    service.attach(Broker.from_url(REDIS_URL, settings.stream_prefix))
    service.consumer.start()
    service.step()
    now = time.monotonic()
    for periodic in service.periodic:
        periodic.last = now
    return service


def _statements_of(service: SchedulerService, step: Callable[[], object]) -> list[str]:
    statements: list[str] = []

    def count(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        statements.append(" ".join(statement.split()))

    event.listen(service.engine, "before_cursor_execute", count)
    try:
        step()
    finally:
        event.remove(service.engine, "before_cursor_execute", count)
    return statements


def _statements_of_one_loop(
    settings: Settings, sessions: sessionmaker[Session], cipher: Cipher, run_id: str
) -> tuple[int, str]:
    ti_id, trigger_id = deferred_task(sessions, cipher, run_id=run_id)
    with sessions.begin() as session:
        session.execute(text("UPDATE dag_run SET evaluate_after = NULL"))
    service = _loop_service(settings)
    service.broker.publish(
        service.keys.events, event_message(cipher, trigger_id, "fired", "triggerer")
    )
    statements = _statements_of(service, service.step)
    with sessions() as session:
        state = session.scalar(select(TaskInstance.state).where(TaskInstance.id == ti_id))
    service.broker.close()
    return len(statements), state or ""


def test_a_loop_with_nothing_to_do_is_one_statement_whatever_the_idle_runs(
    settings: Settings, sessions: sessionmaker[Session], monkeypatch: pytest.MonkeyPatch
) -> None:
    _idle_runs(sessions, first=1, count=2000)
    service = _loop_service(settings)
    monkeypatch.setattr(scheduler_service, "EVENT_BLOCK_MS", 1)  # no event comes

    (statement,) = _statements_of(service, service.step)
    assert statement.startswith("SELECT EXISTS")  # which passes have work: none

    with sessions.begin() as session:  # one run marked: evaluated, in the same loop
        session.execute(text("UPDATE dag_run SET evaluate_after = now() WHERE run_id = 'idle_7'"))
    assert len(_statements_of(service, service.step)) > 1
    with sessions() as session:
        marked = session.scalar(text("SELECT evaluate_after FROM dag_run WHERE run_id = 'idle_7'"))
    assert marked is None or marked > dt.datetime.now(dt.UTC)  # evaluated: not marked now
    service.broker.close()


def test_one_loop_costs_the_same_whatever_the_idle_runs(
    settings: Settings, sessions: sessionmaker[Session], cipher: Cipher, broker: Broker
) -> None:
    _idle_runs(sessions, first=1, count=10)
    few, state = _statements_of_one_loop(settings, sessions, cipher, run_id="with_10")
    assert state == "queued"  # resumed and queued in the same loop

    _idle_runs(sessions, first=11, count=1990)
    many, state = _statements_of_one_loop(settings, sessions, cipher, run_id="with_2000")
    assert state == "queued"

    assert 0 < few < 40
    assert many == few, f"{few} statements with 10 idle runs, {many} with 2,000"
