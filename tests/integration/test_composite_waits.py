"""Waits that compose, against the real PostgreSQL (issue 33): any-of and all-of held as rows
plus one timer, payload filters evaluated by PostgreSQL, cancel-on; deferred through the
worker's deferral path (``record.wait_of``, ``signals.defer_with_waits``), resolved by sends
and by the scheduler's timer pass (``waits.fire_due_timers``)."""

from __future__ import annotations

import datetime as dt
import threading
from collections.abc import Sequence
from typing import Any

import pytest
from sqlalchemy import func, select, text
from sqlalchemy.orm import Session, sessionmaker

from deferral import signals
from deferral.runtime import serialization
from deferral.runtime.config import Settings
from deferral.runtime.crypto import Cipher, Purpose
from deferral.states import TaskState
from deferral.store import transitions, waits
from deferral.store.tables import SignalWait, TaskInstance, TaskStateChange, Trigger, WaitTimer
from deferral.store.transitions import Attempt
from deferral.triggers import (
    AllOf,
    AnyOf,
    DateTimeTrigger,
    HttpTrigger,
    SignalTrigger,
    TimeDeltaTrigger,
)
from deferral.triggers.base import BaseTrigger
from tests.integration.test_signals import WORKER, _events, _resumes, _running
from triggerer import decide
from worker import record
from worker.outcomes import Deferred

SOON = dt.timedelta(minutes=5)


def _defer(
    sessions: sessionmaker[Session],
    cipher: Cipher,
    deferrals: Sequence[tuple[int, BaseTrigger]],
    cancel_on: SignalTrigger | None = None,
    cancel_state: str = "skipped",
) -> dict[int, waits.Wait | None]:
    """Defer the running tasks (id, trigger) as the worker does (record.deferral_of,
    record.wait_of, signals.defer_with_waits); returns each task's wait."""
    specs, found = [], {}
    for ti_id, trigger in deferrals:
        classpath, kwargs = trigger.serialize()
        outcome = Deferred(
            classpath=classpath,
            trigger_kwargs=serialization.check_kwargs(kwargs),
            method_name="resume",
            next_kwargs={},
            trigger_timeout=None,
            cancel_on=None
            if cancel_on is None
            else serialization.check_kwargs(cancel_on.serialize()[1]),
            cancel_state=cancel_state,
        )
        attempt = Attempt(ti_id, 1, WORKER)
        specs.append(record.deferral_of(attempt, outcome, cipher))
        found[ti_id] = record.wait_of(attempt, outcome)
    with sessions.begin() as session:
        moved = signals.defer_with_waits(
            session, cipher, specs, {t: w for t, w in found.items() if w is not None}
        )
    assert set(moved) == {t for t, _ in deferrals}
    return found


def _fire_timers(sessions: sessionmaker[Session], cipher: Cipher, ids: Sequence[int]) -> list[int]:
    """Make the timers of these tasks due now, then run the scheduler's timer pass."""
    with sessions.begin() as session:
        session.execute(
            text(
                "UPDATE wait_timer SET due_at = now() WHERE trigger_id IN"
                " (SELECT trigger_id FROM task_instance WHERE id = ANY(:ids))"
            ),
            {"ids": list(ids)},
        )
    with sessions.begin() as session:
        return waits.fire_due_timers(session, cipher)


def _states(sessions: sessionmaker[Session], ids: Sequence[int]) -> dict[int, str]:
    with sessions() as session:
        rows = session.execute(
            select(TaskInstance.id, TaskInstance.state).where(TaskInstance.id.in_(ids))
        )
        return {r.id: r.state for r in rows}


def test_any_of_signal_or_timer_resumes_each_once_with_its_branch(
    settings: Settings, sessions: sessionmaker[Session], cipher: Cipher
) -> None:
    """100 tasks wait on AnyOf(signal | timer): half signalled, half timed out into the
    default; each resumed once with the right branch and value; nothing to publish for any."""
    ids = _running(sessions, 100)
    moment = dt.datetime.now(dt.UTC) + SOON
    found = _defer(
        sessions,
        cipher,
        [
            (t, AnyOf(signal=SignalTrigger(f"order-{t}"), timeout=DateTimeTrigger(moment)))
            for t in ids
        ],
    )
    assert all(w is not None and w.holds for w in found.values())
    with sessions() as session:  # the reconciler and doctor see no trigger to publish
        published = session.scalar(
            select(func.count())
            .select_from(TaskInstance)
            .where(TaskInstance.id.in_(ids), signals.not_a_wait(TaskInstance.trigger_id))
        )
        assert published == 0
        assert session.scalar(select(func.count()).select_from(WaitTimer)) == 100
    signalled, timed_out = ids[:50], ids[50:]
    for t in signalled:
        assert signals.send(f"order-{t}", {"paid": t}).resumed == (t,)
    assert sorted(_fire_timers(sessions, cipher, ids)) == timed_out
    events = _events(sessions, cipher, ids)
    assert {t: events[t] for t in signalled} == {
        t: {"fired": "signal", "payload": {"paid": t}} for t in signalled
    }
    assert {t: events[t] for t in timed_out} == {
        t: {"fired": "timeout", "payload": moment} for t in timed_out
    }
    assert _resumes(sessions, ids) == dict.fromkeys(ids, 1)
    with sessions() as session:  # the losing branches went with the winner
        assert session.scalar(select(func.count()).select_from(SignalWait)) == 0
        assert session.scalar(select(func.count()).select_from(WaitTimer)) == 0
    assert _fire_timers(sessions, cipher, ids) == []
    assert signals.send(f"order-{ids[-1]}", "late").resumed == ()


def test_all_of_two_signals_resumes_only_after_both(
    settings: Settings, sessions: sessionmaker[Session], cipher: Cipher
) -> None:
    (task,) = _running(sessions, 1)
    found = _defer(
        sessions,
        cipher,
        [(task, AllOf(a=SignalTrigger("both-a"), b=SignalTrigger("both-b")))],
    )
    assert found[task] is not None and found[task].timer is None
    assert signals.send("both-b", {"b": 2}).resumed == ()
    assert signals.send("both-b", "second b: ignored").resumed == ()
    assert _states(sessions, [task]) == {task: "deferred"}
    assert signals.send("both-a", [1]).resumed == (task,)
    assert _events(sessions, cipher, [task]) == {
        task: {"fired": ["a", "b"], "payloads": {"a": [1], "b": {"b": 2}}}
    }
    assert _resumes(sessions, [task]) == {task: 1}


def test_all_of_with_a_time_branch_waits_for_the_moment(
    settings: Settings, sessions: sessionmaker[Session], cipher: Cipher
) -> None:
    early, late = _running(sessions, 2)
    moment = dt.datetime.now(dt.UTC) + SOON
    for task in (early, late):
        _defer(
            sessions,
            cipher,
            [(task, AllOf(go=SignalTrigger(f"go-{task}"), after=DateTimeTrigger(moment)))],
        )
    assert signals.send(f"go-{early}", "yes").resumed == ()  # the moment has not come
    assert _fire_timers(sessions, cipher, [early, late]) == [early]
    assert signals.send(f"go-{late}", "now").resumed == (late,)  # the moment has passed
    assert _events(sessions, cipher, [early, late]) == {
        early: {"fired": ["go", "after"], "payloads": {"go": "yes", "after": moment}},
        late: {"fired": ["go", "after"], "payloads": {"go": "now", "after": moment}},
    }


def test_a_signal_racing_the_timer_resumes_the_task_once(
    settings: Settings, sessions: sessionmaker[Session], cipher: Cipher
) -> None:
    """Each of 20 tasks gets its signal and its due timer at the same moment, from two
    transactions released by one barrier: resumed once, by one branch or the other."""
    ids = _running(sessions, 20)
    _defer(
        sessions,
        cipher,
        [
            (t, AnyOf(signal=SignalTrigger(f"race-{t}"), timeout=TimeDeltaTrigger(SOON)))
            for t in ids
        ],
    )
    errors: list[BaseException] = []
    for t in ids:
        with sessions.begin() as session:  # this task's timer alone is due
            session.execute(
                text(
                    "UPDATE wait_timer SET due_at = now() WHERE trigger_id ="
                    " (SELECT trigger_id FROM task_instance WHERE id = :t)"
                ),
                {"t": t},
            )
        barrier = threading.Barrier(2)

        def send(t: int = t, barrier: threading.Barrier = barrier) -> None:
            try:
                barrier.wait(5)
                signals.send(f"race-{t}", "signal")
            except BaseException as exc:
                errors.append(exc)

        def fire(barrier: threading.Barrier = barrier) -> None:
            try:
                barrier.wait(5)
                with sessions.begin() as session:
                    waits.fire_due_timers(session, cipher)
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=send), threading.Thread(target=fire)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(10)
        assert not errors, errors
    assert _resumes(sessions, ids) == dict.fromkeys(ids, 1)
    fired = {e["fired"] for e in _events(sessions, cipher, ids).values()}
    assert fired <= {"signal", "timeout"}


WHERE = {"status": "paid", "amount": {">=": 100}}


def test_filter_resumes_only_on_matching_signals(
    settings: Settings, sessions: sessionmaker[Session], cipher: Cipher
) -> None:
    """1,000 signals on one key, 10 of them matching a waiter's filter: each of the 10
    waiters resumes once, with its matching payload; the 990 others resume nothing (and
    are recorded)."""
    ids = _running(sessions, 10)
    _defer(
        sessions,
        cipher,
        [(t, SignalTrigger("payments", where={**WHERE, "order": t})) for t in ids],
    )
    misses: list[Any] = [
        {"status": "pending", "amount": 500},
        {"status": "paid", "amount": 99.5},
        {"status": "paid", "amount": "1000"},  # a string is no number
        {"status": "paid"},
        {"amount": 100},
        "paid",
        None,
        [1, 2],
    ]
    payloads = []
    for n in range(990):
        miss = misses[n % len(misses)]
        payloads.append({**miss, "order": ids[n % 10]} if isinstance(miss, dict) else miss)
    for n, t in enumerate(ids):
        payloads.insert(n * 99, {"status": "paid", "amount": 100 + n, "order": t})
    resumed: list[int] = []
    with sessions.begin() as session:
        for payload in payloads:
            resumed += signals.send_in(session, cipher, "payments", payload).resumed
    assert sorted(resumed) == sorted(ids)
    assert _events(sessions, cipher, ids) == {
        t: {"status": "paid", "amount": 100 + n, "order": t} for n, t in enumerate(ids)
    }
    assert _resumes(sessions, ids) == dict.fromkeys(ids, 1)
    with sessions() as session:
        kept = session.scalar(text("SELECT count(*) FROM signal WHERE key = 'payments'"))
    assert kept == 1000


def test_lookback_with_a_filter_matches_only_a_past_matching_signal(
    settings: Settings, sessions: sessionmaker[Session], cipher: Cipher
) -> None:
    matching, unmatched = _running(sessions, 2)
    signals.send("invoices", {"status": "paid", "amount": 150, "n": 1})
    signals.send("invoices", {"status": "paid", "amount": 50, "n": 2})  # newer, too small
    _defer(
        sessions,
        cipher,
        [
            (matching, SignalTrigger("invoices", lookback=SOON, where=WHERE)),
            (unmatched, SignalTrigger("invoices", lookback=SOON, where={"n": {"in": [3, 4]}})),
        ],
    )
    assert _events(sessions, cipher, [matching, unmatched]) == {
        matching: {"status": "paid", "amount": 150, "n": 1}
    }
    assert signals.send("invoices", {"n": 4}).resumed == (unmatched,)


def test_filter_on_a_nested_path_and_an_any_of_branch(
    settings: Settings, sessions: sessionmaker[Session], cipher: Cipher
) -> None:
    (task,) = _running(sessions, 1)
    trigger = AnyOf(
        gold=SignalTrigger("customers", where={"customer.tier": "gold"}),
        timeout=TimeDeltaTrigger(SOON),
    )
    _defer(sessions, cipher, [(task, trigger)])
    assert signals.send("customers", {"customer": {"tier": "silver"}}).resumed == ()
    assert signals.send("customers", {"customer": {"tier": "gold"}}).resumed == (task,)
    assert _events(sessions, cipher, [task]) == {
        task: {"fired": "gold", "payload": {"customer": {"tier": "gold"}}}
    }


@pytest.mark.parametrize("cancel_state", ["skipped", "failed"])
def test_cancel_on_before_the_main_event_ends_the_task_and_kills_its_trigger(
    settings: Settings, sessions: sessionmaker[Session], cipher: Cipher, cancel_state: str
) -> None:
    """A task waiting on a running trigger (an HTTP poll) with a cancel-on: the matching
    cancel signal ends it in ``cancel_state`` and drops its trigger, with a reason the
    triggerer reads as a cancel (on_kill); a non-matching one does nothing."""
    (task,) = _running(sessions, 1, run_id=f"cancel_{cancel_state}")
    found = _defer(
        sessions,
        cipher,
        [(task, HttpTrigger("http://example.invalid/ready"))],
        cancel_on=SignalTrigger("orders", where={"cancelled": True}),
        cancel_state=cancel_state,
    )
    wait = found[task]
    assert wait is not None and not wait.holds  # the poll is published to a triggerer
    with sessions() as session:
        trigger_id = session.scalar(select(TaskInstance.trigger_id).where(TaskInstance.id == task))
        assert session.scalar(
            select(func.count())
            .select_from(TaskInstance)
            .where(TaskInstance.id == task, signals.not_a_wait(TaskInstance.trigger_id))
        )  # the reconciler still republishes its entry
    assert signals.send("orders", {"cancelled": False}).resumed == ()
    assert signals.send("orders", {"cancelled": True}).resumed == (task,)
    assert _states(sessions, [task]) == {task: cancel_state}
    with sessions() as session:
        assert session.get(Trigger, trigger_id) is None
        reason = session.scalar(
            select(TaskStateChange.reason)
            .where(TaskStateChange.task_instance_id == task)
            .order_by(TaskStateChange.id.desc())
            .limit(1)
        )
    assert reason is not None and reason.startswith(transitions.CANCELLED_BY)
    assert decide.cancel_reason(trigger_id, cancel_state, None, reason) == decide.USER_ACTION


def test_cancel_on_before_a_timer_skips_the_task_and_its_event_then_does_nothing(
    settings: Settings, sessions: sessionmaker[Session], cipher: Cipher
) -> None:
    """A task waiting on a near timer (published to a triggerer) is skipped by its cancel
    signal; the timer's event, when the triggerer fires it,
    finds no task waiting (stale)."""
    (task,) = _running(sessions, 1)
    found = _defer(
        sessions, cipher, [(task, TimeDeltaTrigger(SOON))], cancel_on=SignalTrigger("halt")
    )
    wait = found[task]
    assert wait is not None and not wait.holds
    with sessions() as session:
        trigger_id = session.scalar(select(TaskInstance.trigger_id).where(TaskInstance.id == task))
    assert signals.send("halt", "stop it").resumed == (task,)
    assert _states(sessions, [task]) == {task: TaskState.SKIPPED}
    assert trigger_id is not None
    with sessions.begin() as session:
        fired = transitions.FiredEvent(f"timer-event:{trigger_id}", trigger_id, False, "moment")
        assert transitions.resume(session, fired, cipher).outcome == "stale"
    assert _states(sessions, [task]) == {task: TaskState.SKIPPED}


def test_cancel_on_after_the_timer_does_nothing(
    settings: Settings, sessions: sessionmaker[Session], cipher: Cipher
) -> None:
    """The timer first: the cancel signal finds nothing. (And a timer whose task no longer
    waits on its trigger, here moved away behind the store's back, is dropped by the pass.)"""
    task, gone = _running(sessions, 2)
    _defer(
        sessions,
        cipher,
        [(task, AnyOf(timeout=TimeDeltaTrigger(SOON))), (gone, AnyOf(t=TimeDeltaTrigger(SOON)))],
        cancel_on=SignalTrigger("stop"),
    )
    with sessions.begin() as session:
        session.execute(
            text("UPDATE task_instance SET state = 'success' WHERE id = :id"), {"id": gone}
        )
    assert _fire_timers(sessions, cipher, [task, gone]) == [task]
    assert signals.send("stop", None).resumed == ()
    assert _states(sessions, [task]) == {task: TaskState.SCHEDULED}
    assert _resumes(sessions, [task]) == {task: 1}
    with sessions() as session:
        assert session.scalar(select(func.count()).select_from(WaitTimer)) == 0
        # The moved task's cancel-on row stays with its trigger row, which nothing resumes.
        assert session.scalar(select(func.count()).select_from(SignalWait)) == 1


def test_event_sealed_as_the_task_opens_it(
    settings: Settings, sessions: sessionmaker[Session], cipher: Cipher
) -> None:
    """The resumed task's event opens as the worker opens it (record.resume_kwargs)."""
    (task,) = _running(sessions, 1)
    _defer(sessions, cipher, [(task, AnyOf(ok=SignalTrigger("sealed")))])
    signals.send("sealed", {"v": 1})
    with sessions() as session:
        ti = session.get(TaskInstance, task)
        assert ti is not None
        kwargs = record.resume_kwargs(cipher, ti.next_kwargs, ti.next_event)
    assert kwargs == {"event": {"fired": "ok", "payload": {"v": 1}}}
    assert cipher.open(Purpose.EVENT, ti.next_event) == {"fired": "ok", "payload": {"v": 1}}
