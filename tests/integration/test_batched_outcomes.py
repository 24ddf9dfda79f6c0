"""Outcomes recorded a batch at a time are fenced row by row: an attempt that is no longer the
worker's changes nothing, the others move."""

from __future__ import annotations

import datetime as dt

from sqlalchemy import Connection, event, select
from sqlalchemy.orm import Session, sessionmaker

from deferral.store import transitions
from deferral.store.tables import TaskInstance, TaskLog, TaskStateChange, Trigger, XCom
from deferral.store.transitions import Attempt, Deferral
from tests.integration.factories import WORKER, running_task


def _state(sessions: sessionmaker[Session], ti_id: int) -> TaskInstance:
    with sessions() as session:
        ti = session.get(TaskInstance, ti_id)
        assert ti is not None
        return ti


def test_succeed_many_moves_only_attempts_still_ours(sessions: sessionmaker[Session]) -> None:
    ours = running_task(sessions, task_id="a", run_id="r1")
    stale = running_task(sessions, task_id="b", run_id="r2")
    with sessions.begin() as session:
        moved = transitions.succeed_many(
            session,
            [(Attempt(ours, 1, WORKER), {"n": 1}), (Attempt(stale, 1, "someone-else"), "lost")],
        )
    assert moved == {ours}
    assert _state(sessions, ours).state == "success"
    assert _state(sessions, stale).state == "running"
    with sessions() as session:
        assert session.scalars(select(XCom.task_instance_id)).all() == [ours]


def test_succeed_many_writes_the_line_of_each_try_that_moved_in_its_statement(
    sessions: sessionmaker[Session],
) -> None:
    """The worker's "succeeded" line comes with the move (a statement less on every success's
    path), and only for the attempts still ours."""
    ours = running_task(sessions, task_id="a", run_id="r1")
    stale = running_task(sessions, task_id="b", run_id="r2")
    statements: list[str] = []

    def seen(conn: Connection, cursor: object, statement: str, *args: object) -> None:
        statements.append(statement)

    engine = sessions.kw["bind"]
    event.listen(engine, "before_cursor_execute", seen)
    try:
        with sessions.begin() as session:
            moved, _ = transitions.succeed_recording(
                session,
                [(Attempt(ours, 1, WORKER), None), (Attempt(stale, 1, "someone-else"), None)],
                said="succeeded",
            )
    finally:
        event.remove(engine, "before_cursor_execute", seen)
    assert moved == {ours}
    assert len(statements) == 1
    with sessions() as session:
        lines = session.execute(select(TaskLog.task_instance_id, TaskLog.source, TaskLog.text))
        assert [tuple(line) for line in lines] == [(ours, "worker", "succeeded")]


def test_defer_many_writes_triggers_and_drops_those_of_stale_attempts(
    sessions: sessionmaker[Session],
) -> None:
    first = running_task(sessions, task_id="a", run_id="r1")
    second = running_task(sessions, task_id="b", run_id="r2")
    stale = running_task(sessions, task_id="c", run_id="r3")
    timeout = dt.datetime.now(dt.UTC) + dt.timedelta(hours=1)

    def deferral(ti_id: int, worker: str, trigger_timeout: dt.datetime | None) -> Deferral:
        return Deferral(
            attempt=Attempt(ti_id, 1, worker),
            classpath="x.Trigger",
            kwargs_token=f"kwargs-{ti_id}",
            next_method="resume",
            next_kwargs_token=f"next-{ti_id}",
            trigger_timeout=trigger_timeout,
        )

    with sessions.begin() as session:
        moved = transitions.defer_many(
            session,
            [
                deferral(first, WORKER, None),
                deferral(second, WORKER, timeout),
                deferral(stale, "someone-else", None),
            ],
        )
    assert set(moved) == {first, second}
    for ti_id in (first, second):
        ti = _state(sessions, ti_id)
        assert (ti.state, ti.trigger_id, ti.next_kwargs) == (
            "deferred",
            moved[ti_id],
            f"next-{ti_id}",
        )
    assert _state(sessions, second).trigger_timeout == timeout
    assert _state(sessions, first).trigger_timeout is None
    assert _state(sessions, stale).state == "running"
    with sessions() as session:
        kwargs = dict(session.execute(select(Trigger.id, Trigger.kwargs)).all())
        reasons = session.scalars(
            select(TaskStateChange.reason).where(TaskStateChange.to_state == "deferred")
        ).all()
    assert kwargs == {moved[first]: f"kwargs-{first}", moved[second]: f"kwargs-{second}"}
    assert sorted(reasons) == sorted(f"deferred to trigger {moved[i]}" for i in (first, second))
