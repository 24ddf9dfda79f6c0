"""Asset event and approval waits against the real PostgreSQL (issue 33): ``AssetEventTrigger``
alone and as a branch of an ``AnyOf`` / ``AllOf``, held as a row and resumed in the transaction
that records an event of its asset (a watcher's, a success with outlets); ``ApprovalTrigger``
as a branch, listed and answered as an HITLOperator's request; the read model's view of a
composite with a running branch and of ``deferral signals list``."""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence

import pytest
from sqlalchemy import func, select, text
from sqlalchemy.orm import Session, sessionmaker

from deferral import signals
from deferral.assets import Asset
from deferral.runtime.config import Settings
from deferral.runtime.crypto import Cipher
from deferral.store import hitl, waits
from deferral.store.tables import SignalWait, TaskInstance
from deferral.store.transitions import Attempt
from deferral.store.transitions.asset_events import record_watcher_event
from deferral.triggers import (
    AllOf,
    AnyOf,
    ApprovalTrigger,
    AssetEventTrigger,
    DateTimeTrigger,
    HttpTrigger,
    SignalTrigger,
)
from deferral.triggers.signal import SignalError
from readmodel import explain
from readmodel import waits as read_waits
from tests.integration.test_composite_waits import SOON, _defer, _fire_timers
from tests.integration.test_signals import WORKER, _events, _resumes, _running
from worker import record
from worker.outcomes import Succeeded

ORDERS = Asset("orders", uri="s3://bucket/orders")


def _record_event(
    sessions: sessionmaker[Session], cipher: Cipher, key: str, extra: dict[str, int]
) -> tuple[int, list[int]]:
    """Record a watcher's event of ORDERS as the triggerer does; its id and the tasks moved."""
    with sessions.begin() as session:
        session.execute(
            text("INSERT INTO asset (name, uri) VALUES (:n, :u) ON CONFLICT DO NOTHING"),
            {"n": ORDERS.name, "u": ORDERS.uri},
        )
        event_id = record_watcher_event(session, ORDERS.name, "w", key, extra)
        assert event_id is not None
        return event_id, waits.resume_asset_waiters(session, cipher, [event_id])


def _waiting(sessions: sessionmaker[Session], ids: Sequence[int]) -> int:
    with sessions() as session:
        return int(
            session.scalar(
                select(func.count())
                .select_from(TaskInstance)
                .where(TaskInstance.id.in_(ids), TaskInstance.state == "deferred")
            )
            or 0
        )


def test_any_of_asset_event_resumes_once_with_the_event_and_no_earlier_event_fires_it(
    settings: Settings, sessions: sessionmaker[Session], cipher: Cipher
) -> None:
    ids = _running(sessions, 3)
    _record_event(sessions, cipher, "before", {"n": 0})  # before the waits began: not theirs
    moment = dt.datetime.now(dt.UTC) + SOON
    found = _defer(
        sessions,
        cipher,
        [
            (t, AnyOf(data=AssetEventTrigger(ORDERS), timeout=DateTimeTrigger(moment)))
            for t in ids[:2]
        ]
        + [(ids[2], AssetEventTrigger("orders"))],
    )
    assert all(w is not None and w.holds for w in found.values())
    assert _waiting(sessions, ids) == 3
    event_id, moved = _record_event(sessions, cipher, "k1", {"rows": 7})
    assert sorted(moved) == ids
    events = _events(sessions, cipher, ids)
    fired = events[ids[0]]
    assert fired["fired"] == "data"
    assert {k: v for k, v in fired["payload"].items() if k != "timestamp"} == {
        "id": event_id,
        "name": "orders",
        "uri": "s3://bucket/orders",
        "extra": {"rows": 7},
    }
    assert isinstance(fired["payload"]["timestamp"], dt.datetime)
    assert events[ids[1]]["payload"]["id"] == event_id
    assert events[ids[2]]["id"] == event_id  # a plain wait resumes with the event itself
    assert _record_event(sessions, cipher, "k2", {})[1] == []  # resumed once
    assert _resumes(sessions, ids) == dict.fromkeys(ids, 1)
    assert _fire_timers(sessions, cipher, ids) == []
    with sessions() as session:
        assert session.scalar(select(func.count()).select_from(SignalWait)) == 0


def test_timer_branch_wins_when_no_event_comes(
    settings: Settings, sessions: sessionmaker[Session], cipher: Cipher
) -> None:
    (t,) = _running(sessions, 1)
    moment = dt.datetime.now(dt.UTC) + SOON
    _defer(
        sessions,
        cipher,
        [(t, AnyOf(data=AssetEventTrigger(ORDERS), timeout=DateTimeTrigger(moment)))],
    )
    assert _fire_timers(sessions, cipher, [t]) == [t]
    assert _events(sessions, cipher, [t]) == {t: {"fired": "timeout", "payload": moment}}
    assert _record_event(sessions, cipher, "late", {})[1] == []
    assert _resumes(sessions, [t]) == {t: 1}


def test_all_of_signal_and_asset_event_resumes_after_both(
    settings: Settings, sessions: sessionmaker[Session], cipher: Cipher
) -> None:
    (t,) = _running(sessions, 1)
    _defer(
        sessions,
        cipher,
        [(t, AllOf(approved=SignalTrigger("go"), data=AssetEventTrigger(ORDERS)))],
    )
    event_id, moved = _record_event(sessions, cipher, "k1", {"rows": 1})
    assert moved == []
    assert _record_event(sessions, cipher, "k2", {"rows": 2})[1] == []  # the first one is kept
    assert signals.send("go", {"ok": True}).resumed == (t,)
    event = _events(sessions, cipher, [t])[t]
    assert event["fired"] == ["approved", "data"]
    assert event["payloads"]["approved"] == {"ok": True}
    assert event["payloads"]["data"]["id"] == event_id
    assert event["payloads"]["data"]["extra"] == {"rows": 1}


def test_a_success_with_the_asset_as_outlet_resumes_its_waiters(
    settings: Settings, sessions: sessionmaker[Session], cipher: Cipher
) -> None:
    producer, waiter = _running(sessions, 2)
    _defer(sessions, cipher, [(waiter, AnyOf(data=AssetEventTrigger(ORDERS)))])
    with sessions.begin() as session:
        session.execute(
            text("INSERT INTO task_outlet_asset (dag_id, task_id, asset_name) VALUES (:d, :t, :a)"),
            {"d": "signals_dag", "t": "t0", "a": ORDERS.name},
        )
    with sessions.begin() as session:
        done = record.succeed_all(
            session,
            cipher,
            [(Attempt(producer, 1, WORKER), Succeeded(None, (), {"orders": {"v": 2}}))],
        )
    assert done == {producer}
    payload = _events(sessions, cipher, [waiter])[waiter]["payload"]
    assert (payload["name"], payload["uri"], payload["extra"]) == ("orders", "orders", {"v": 2})
    assert payload["id"] > 0


def test_bad_asset_is_refused_naming_it() -> None:
    with pytest.raises(SignalError, match="asset 42 is invalid"):
        AssetEventTrigger(42)


def test_read_model_shows_a_running_branch_and_signals_list_skips_cancel_keys(
    settings: Settings, sessions: sessionmaker[Session], cipher: Cipher
) -> None:
    held, running, plain = _running(sessions, 3)
    _defer(sessions, cipher, [(held, AnyOf(data=AssetEventTrigger(ORDERS)))])
    _defer(
        sessions,
        cipher,
        [(running, AnyOf(poll=HttpTrigger("http://127.0.0.1:9/x"), sig=SignalTrigger("s1")))],
    )
    _defer(sessions, cipher, [(plain, AssetEventTrigger(ORDERS))], cancel_on=SignalTrigger("stop"))
    with sessions() as session:
        page = read_waits.deferred_now(session, settings)
        rows = {g["tasks"][0]["trigger_id"]: g for g in page["groups"]}
        ti = {
            t.id: t
            for t in session.scalars(
                select(TaskInstance).where(TaskInstance.id.in_([held, running, plain]))
            )
        }
        assert rows[ti[held].trigger_id]["row_wait"] == "composite"
        assert rows[ti[running].trigger_id]["row_wait"] is None
        assert rows[ti[running].trigger_id]["running_branch"]
        now = dt.datetime.now(dt.UTC)
        said = "\n".join(explain._explain_deferred(session, settings, ti[running], now))
        assert read_waits.RUNNING_COMPOSITE in said
        said = "\n".join(explain._explain_deferred(session, settings, ti[plain], now))
        assert "an event of asset 'orders'" in said
        keys = {a.key for a in signals.activity(session)}
    assert "s1" in keys and "stop" not in keys and "asset/orders" not in keys


def test_a_batch_of_successes_and_waits_locks_all_its_keys_in_one_statement(
    settings: Settings, sessions: sessionmaker[Session], cipher: Cipher
) -> None:
    (producer,) = _running(sessions, 1)
    with sessions.begin() as session:
        session.execute(
            text("INSERT INTO task_outlet_asset (dag_id, task_id, asset_name) VALUES (:d, :t, :a)"),
            {"d": "signals_dag", "t": "t0", "a": ORDERS.name},
        )
    held = text(
        "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND pid = pg_backend_pid()"
    )
    with sessions.begin() as session:
        waits.lock_batch_keys(session, [producer], [], [])  # no waits: nothing taken early
        assert session.scalar(held) == 0
        waits.lock_batch_keys(session, [producer], ["found"], ["go"])
        assert session.scalar(held) == 3  # go, asset/orders, asset/found


def test_approval_branch_is_listed_answered_once_and_retired_by_the_timer(
    settings: Settings, sessions: sessionmaker[Session], cipher: Cipher
) -> None:
    answered, timed_out = _running(sessions, 2)
    moment = dt.datetime.now(dt.UTC) + SOON
    ask = ApprovalTrigger("Ship it?", options=["yes", "no"], body="release 1.2")
    _defer(
        sessions,
        cipher,
        [(t, AnyOf(approved=ask, timeout=DateTimeTrigger(moment))) for t in (answered, timed_out)],
    )
    with sessions() as session:
        listed = {a.task_instance_id: a for a in hitl.required_actions(session)}
    assert set(listed) == {answered, timed_out}
    assert (listed[answered].subject, listed[answered].options) == ("Ship it?", ["yes", "no"])
    assert listed[answered].state == "deferred"
    with sessions.begin() as session, pytest.raises(hitl.ResponseError, match="maybe"):
        hitl.respond(session, cipher, answered, ["maybe"], None, "ada")
    with sessions.begin() as session:
        hitl.respond(session, cipher, answered, ["yes"], None, "ada")
    event = _events(sessions, cipher, [answered])[answered]
    assert event["fired"] == "approved"
    assert event["payload"]["chosen_options"] == ["yes"]
    assert event["payload"]["responded_by_user"] == "ada"
    with sessions.begin() as session, pytest.raises(hitl.NotAwaitingInput, match="already"):
        hitl.respond(session, cipher, answered, ["no"], None, "bob")
    assert _fire_timers(sessions, cipher, [answered, timed_out]) == [timed_out]
    with sessions() as session:
        assert hitl.required_actions(session) == []  # the timer retired the request
    with sessions.begin() as session, pytest.raises(hitl.NotAwaitingInput, match="not awaiting"):
        hitl.respond(session, cipher, timed_out, ["yes"], None, "ada")
    assert _resumes(sessions, [answered, timed_out]) == {answered: 1, timed_out: 1}


def test_bad_approval_is_refused_naming_it() -> None:
    with pytest.raises(SignalError, match="approval options"):
        ApprovalTrigger("Ship it?", options=["yes", "yes"])
