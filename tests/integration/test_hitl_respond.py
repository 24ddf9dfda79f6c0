"""Responses to tasks awaiting input against real PostgreSQL: one applies, with who and when;
a second, a response to a task not awaiting input, or to none, is refused in one line and
changes nothing; the timeout applies once however many schedulers expire at once."""

from __future__ import annotations

import datetime as dt
import threading

import pytest
from sqlalchemy import select, update
from sqlalchemy.orm import Session, sessionmaker

from deferral.runtime.crypto import Cipher, Purpose
from deferral.states import TaskState
from deferral.store import hitl
from deferral.store.tables import HITLDetail, TaskInstance
from tests.integration.factories import awaiting_input_task


def _state(sessions: sessionmaker[Session], ti_id: int) -> str:
    with sessions() as session:
        ti = session.get(TaskInstance, ti_id)
        assert ti is not None
        return ti.state


def test_one_response_applies_and_a_second_is_refused(
    sessions: sessionmaker[Session], cipher: Cipher
) -> None:
    ti_id = awaiting_input_task(sessions, "ask", "r1")
    with sessions.begin() as session:
        event = hitl.respond(session, cipher, ti_id, ["no"], None, "alice")
    assert event["chosen_options"] == ["no"] and event["responded_by_user"] == "alice"
    assert _state(sessions, ti_id) == TaskState.SCHEDULED
    with sessions.begin() as session, pytest.raises(hitl.NotAwaitingInput) as caught:
        hitl.respond(session, cipher, ti_id, ["yes"], None, "bob")
    assert str(caught.value).startswith(
        "task factory_dag.r1.ask was already responded to by alice at"
    )
    with sessions() as session:
        detail = session.get(HITLDetail, ti_id)
        ti = session.get(TaskInstance, ti_id)
        assert detail is not None and ti is not None
        assert (detail.responded_by, detail.chosen_options) == ("alice", ["no"])
        assert ti.next_method == "execute_complete"
        assert cipher.open(Purpose.EVENT, ti.next_event)["chosen_options"] == ["no"]


def test_responses_to_tasks_not_awaiting_input_are_refused(
    sessions: sessionmaker[Session], cipher: Cipher
) -> None:
    ti_id = awaiting_input_task(sessions, "ask", "r2")
    with sessions.begin() as session:
        session.execute(
            update(TaskInstance).where(TaskInstance.id == ti_id).values(state="success")
        )
    with sessions.begin() as session, pytest.raises(hitl.NotAwaitingInput, match="state success"):
        hitl.respond(session, cipher, ti_id, ["yes"], None, "alice")
    with sessions.begin() as session, pytest.raises(hitl.NoSuchTask, match="does not exist"):
        hitl.respond(session, cipher, ti_id + 1000, ["yes"], None, "alice")
    with sessions.begin() as session, pytest.raises(hitl.ResponseError, match="unknown option"):
        hitl.respond(
            session, cipher, awaiting_input_task(sessions, "ask", "r3"), ["maybe"], None, "alice"
        )
    assert _state(sessions, ti_id) == TaskState.SUCCESS


def test_the_timeout_applies_the_defaults_once_across_replicas(
    sessions: sessionmaker[Session], cipher: Cipher
) -> None:
    with_default = awaiting_input_task(sessions, "ask", "t1", ("no",))
    without = awaiting_input_task(sessions, "ask", "t2")
    with sessions.begin() as session:
        session.execute(
            update(HITLDetail).values(timeout_at=dt.datetime.now(dt.UTC) - dt.timedelta(seconds=1))
        )
    expired: list[int] = []
    barrier = threading.Barrier(4)

    def replica() -> None:
        barrier.wait()
        with sessions.begin() as session:
            expired.extend(hitl.expire(session, cipher))

    threads = [threading.Thread(target=replica) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(expired) == sorted([with_default, without])
    with sessions() as session:
        by_id = {d.task_instance_id: d for d in session.scalars(select(HITLDetail))}
        events = {
            ti.id: cipher.open(Purpose.EVENT, ti.next_event)
            for ti in session.scalars(select(TaskInstance))
        }
    assert by_id[with_default].chosen_options == ["no"] and by_id[with_default].responded_by is None
    assert events[with_default]["timedout"] is True
    assert events[without]["chosen_options"] is None  # execute_complete raises HITLTimeoutError
