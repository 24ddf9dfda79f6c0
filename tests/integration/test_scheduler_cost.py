"""A scheduler loop's work depends on what changed, not on how many runs merely wait: the SQL
statements of one loop that applies one fired event (and queues its task in that same loop) are
the same with 10 and with 2,000 runs whose tasks are all deferred."""

from __future__ import annotations

import time
from typing import Any

from sqlalchemy import event, select, text
from sqlalchemy.orm import Session, sessionmaker

from broker.client import Broker
from deferral.config import Settings
from deferral.crypto import Cipher
from deferral.models import TaskInstance
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
                    INSERT INTO trigger (classpath, kwargs, fingerprint)
                    SELECT 'deferral.triggers.temporal.DateTimeTrigger', 'sealed', run_id
                    FROM runs
                    RETURNING id, fingerprint AS run_id
                )
                INSERT INTO task_instance (dag_id, run_id, task_id, state, try_number, trigger_id,
                                           next_method)
                SELECT 'idle', run_id, 'wait', 'deferred', 1, id, 'resume' FROM triggers
                """
            ),
            {"first": first, "count": count},
        )


def _statements_of_one_loop(
    settings: Settings, sessions: sessionmaker[Session], cipher: Cipher, run_id: str
) -> tuple[int, str]:
    ti_id, trigger_id = deferred_task(sessions, cipher, run_id=run_id)
    with sessions.begin() as session:
        session.execute(text("UPDATE dag_run SET evaluate_after = NULL"))
    service = SchedulerService(settings, name="cost")
    service.attach(Broker.from_url(REDIS_URL, settings.stream_prefix))
    service.consumer.start()
    service.step()  # the periodic work runs on the first loop; the measured one has none due
    now = time.monotonic()
    for periodic in service.periodic:
        periodic.last = now

    service.broker.publish(
        service.keys.events, event_message(cipher, trigger_id, "fired", "triggerer")
    )
    statements: list[str] = []

    def count(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        statements.append(statement.split()[0])

    event.listen(service.engine, "before_cursor_execute", count)
    service.step()
    event.remove(service.engine, "before_cursor_execute", count)
    with sessions() as session:
        state = session.scalar(select(TaskInstance.state).where(TaskInstance.id == ti_id))
    service.broker.close()
    return len(statements), state or ""


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
