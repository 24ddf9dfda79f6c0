"""Signals against the real PostgreSQL: waits recorded by the worker's deferral path
(``signals.defer_with_waits``), sends through the library, the API and the CLI."""

from __future__ import annotations

import base64
import datetime as dt
import json
import random
import threading
from collections.abc import Sequence
from typing import Any

import pytest
from click.testing import CliRunner
from cryptography.fernet import Fernet
from sqlalchemy import func, select, text
from sqlalchemy.orm import Session, sessionmaker

from broker.client import Broker
from deferral import signals
from deferral.exceptions import TaskDeferralError, deferral_failure
from deferral.runtime import serialization
from deferral.runtime.config import Settings
from deferral.runtime.crypto import Cipher, Purpose
from deferral.states import FAIL_METHOD, TaskState
from deferral.store import transitions, waits
from deferral.store.callback_tokens import make_token
from deferral.store.tables import DagRun, Signal, SignalWait, TaskInstance, TaskStateChange
from deferral.store.transitions import Attempt, NewTaskInstance
from deferral.triggers.base import BaseTrigger
from deferral.triggers.signal import CallbackTrigger, SignalError, SignalTrigger
from deferral_cli import main as deferral_main
from deferral_cli.wait import read_status
from readmodel.doctor import _not_in_flight
from readmodel.explain import explain
from scheduler.reconcile import Reconciler
from tests.integration.conftest import WEB_ADMIN_PASSWORD, web_client
from tests.integration.factories import defer_running

WORKER = "worker-1"


def _running(sessions: sessionmaker[Session], count: int, run_id: str = "r1") -> list[int]:
    """A run of ``count`` tasks t0..t<count-1>, each started on WORKER."""
    with sessions.begin() as session:
        transitions.create_dag_run(session, "signals_dag", run_id, dt.datetime.now(dt.UTC), {})
        run = session.scalars(select(DagRun).where(DagRun.run_id == run_id)).one()
        transitions.start_dag_run(
            session,
            run,
            [NewTaskInstance(f"t{i}", 0, "default_pool", 1, "default", 1) for i in range(count)],
        )
        session.flush()
        ids = list(
            session.scalars(
                select(TaskInstance.id).where(TaskInstance.run_id == run_id).order_by("id")
            )
        )
        transitions.schedule(session, ids)
        transitions.dispatch(session, ids)
        assert transitions.start_many(session, [(i, 1) for i in ids], "host", WORKER)
    return ids


def _wait(
    sessions: sessionmaker[Session],
    cipher: Cipher,
    waits: Sequence[tuple[int, str]],
    lookback: dt.timedelta = dt.timedelta(0),
) -> None:
    """Defer the running tasks (id, key) on SignalTrigger(key, lookback), as the worker does."""
    _defer(sessions, cipher, [(t, SignalTrigger(key, lookback)) for t, key in waits])


def _defer(
    sessions: sessionmaker[Session],
    cipher: Cipher,
    deferrals: Sequence[tuple[int, BaseTrigger]],
    try_number: int = 1,
) -> None:
    """Defer the running tasks (id, trigger) through the worker's deferral path."""
    specs, found = [], {}
    for ti_id, trigger in deferrals:
        classpath, kwargs = trigger.serialize()
        jsonable = serialization.check_kwargs(kwargs)
        wait = signals.wait_of(classpath, jsonable, ti_id, try_number)
        assert wait is not None
        found[ti_id] = wait
        specs.append(
            transitions.Deferral(
                attempt=Attempt(ti_id, try_number, WORKER),
                classpath=classpath,
                kwargs_token=cipher.encrypt(Purpose.TRIGGER_KWARGS, serialization.encode(jsonable)),
                next_method="resume",
                next_kwargs_token=cipher.seal(Purpose.RESUME_KWARGS, {}),
                trigger_timeout=None,
            )
        )
    with sessions.begin() as session:
        moved = signals.defer_with_waits(session, cipher, specs, found)
    assert set(moved) == set(found)


def _events(sessions: sessionmaker[Session], cipher: Cipher, ids: Sequence[int]) -> dict[int, Any]:
    """The event each resumed task (scheduled) got; the others absent."""
    with sessions() as session:
        rows = session.execute(
            select(TaskInstance.id, TaskInstance.next_event).where(
                TaskInstance.id.in_(ids), TaskInstance.state == TaskState.SCHEDULED
            )
        )
        return {r.id: cipher.open(Purpose.EVENT, r.next_event) for r in rows}


def _resumes(sessions: sessionmaker[Session], ids: Sequence[int]) -> dict[int, int]:
    with sessions() as session:
        rows = session.execute(
            select(TaskStateChange.task_instance_id, func.count())
            .where(
                TaskStateChange.task_instance_id.in_(ids),
                TaskStateChange.from_state == "deferred",
                TaskStateChange.to_state == "scheduled",
            )
            .group_by(TaskStateChange.task_instance_id)
        )
        return {r[0]: r[1] for r in rows}


def _basic() -> dict[str, str]:
    encoded = base64.b64encode(f"admin:{WEB_ADMIN_PASSWORD}".encode()).decode()
    return {"authorization": f"Basic {encoded}"}


def test_hundred_keys_through_api_cli_and_library_each_resume_once(
    settings: Settings, sessions: sessionmaker[Session], cipher: Cipher
) -> None:
    ids = _running(sessions, 100)
    keys = {ti_id: f"order-{n}" for n, ti_id in enumerate(ids)}
    _wait(sessions, cipher, list(keys.items()))
    payloads = {ti_id: {"n": n, "via": ("api", "cli", "lib")[n % 3]} for n, ti_id in enumerate(ids)}
    with web_client(settings, "0.0.0.0") as client:
        for ti_id, payload in payloads.items():
            key = keys[ti_id]
            if payload["via"] == "api":
                answer = client.post(
                    f"/api/v1/signals/{key}", json={"payload": payload}, headers=_basic()
                )
                assert answer.status_code == 201, answer.text
                assert answer.json()["resumed"] == 1
            elif payload["via"] == "cli":
                result = CliRunner().invoke(
                    deferral_main, ["signals", "send", key, "--payload", json.dumps(payload)]
                )
                assert result.exit_code == 0, result.output
                assert "1 task(s) resumed" in result.output
            else:
                assert len(signals.send(key, payload).resumed) == 1
    assert _events(sessions, cipher, ids) == payloads
    # Every key signalled again: nobody waits any more, nothing moves.
    for key in keys.values():
        assert signals.send(key, "again").resumed == ()
    assert _resumes(sessions, ids) == dict.fromkeys(ids, 1)


def test_lookback_matches_a_signal_sent_within_it_only(
    settings: Settings, sessions: sessionmaker[Session], cipher: Cipher
) -> None:
    near, far = _running(sessions, 2)
    two = signals.send("near", "two seconds ago")
    ten = signals.send("far", "ten seconds ago")
    with sessions.begin() as session:  # recorded timestamps, not sleeps
        for sent, age in ((two, 2), (ten, 10)):
            session.execute(
                text(
                    "UPDATE signal SET sent_at = clock_timestamp() - make_interval(secs => :a)"
                    " WHERE id = :id"
                ),
                {"a": age, "id": sent.id},
            )
    _wait(sessions, cipher, [(near, "near"), (far, "far")], lookback=dt.timedelta(seconds=5))
    assert _events(sessions, cipher, [near, far]) == {near: "two seconds ago"}
    # The unmatched one waits for the next signal.
    assert signals.send("far", "now").resumed == (far,)
    assert _events(sessions, cipher, [far]) == {far: "now"}


def test_two_tasks_on_one_key_both_resume_on_one_signal(
    settings: Settings, sessions: sessionmaker[Session], cipher: Cipher
) -> None:
    a, b = _running(sessions, 2)
    _wait(sessions, cipher, [(a, "shared"), (b, "shared")])
    assert sorted(signals.send("shared", {"go": True}).resumed) == [a, b]
    assert _events(sessions, cipher, [a, b]) == {a: {"go": True}, b: {"go": True}}


def test_signal_nobody_waits_on_is_recorded_and_harms_nothing(
    settings: Settings, sessions: sessionmaker[Session], cipher: Cipher
) -> None:
    (waiter,) = _running(sessions, 1)
    _wait(sessions, cipher, [(waiter, "mine")])
    sent = signals.send("nobody", [1, 2, 3])
    assert sent.resumed == ()
    with sessions() as session:
        assert session.get(Signal, sent.id) is not None
        assert session.get(TaskInstance, waiter).state == TaskState.DEFERRED  # type: ignore[union-attr]
        listed = {a.key: a for a in signals.activity(session)}
    assert listed["nobody"].signals == 1 and listed["nobody"].waiting == ()
    assert listed["mine"].signals == 0 and listed["mine"].waiting == ("signals_dag.r1.t0",)
    result = CliRunner().invoke(deferral_main, ["signals", "list", "--json"])
    assert result.exit_code == 0, result.output
    assert {r["key"]: r["waiting"] for r in json.loads(result.output)} == {"nobody": 0, "mine": 1}
    table = CliRunner().invoke(deferral_main, ["signals", "list"])
    assert table.exit_code == 0 and "nobody" in table.output
    assert "signals_dag.r1.t0" in table.output


def test_thousand_concurrent_signals_while_waits_are_created_lose_none(
    settings: Settings, sessions: sessionmaker[Session], cipher: Cipher
) -> None:
    ids = _running(sessions, 1000)
    keys = {ti_id: f"race-{n}" for n, ti_id in enumerate(ids)}
    batches = [ids[i : i + 25] for i in range(0, len(ids), 25)]
    order = list(ids)
    random.Random(18).shuffle(order)
    errors: list[BaseException] = []

    def waits(part: Sequence[list[int]]) -> None:
        try:
            for batch in part:
                _wait(sessions, cipher, [(t, keys[t]) for t in batch], dt.timedelta(hours=1))
        except BaseException as exc:
            errors.append(exc)

    def sends(part: Sequence[int]) -> None:
        try:
            for ti_id in part:
                signals.send(keys[ti_id], ti_id)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=waits, args=(batches[i::2],)) for i in range(2)]
    threads += [threading.Thread(target=sends, args=(order[i::6],)) for i in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert _events(sessions, cipher, ids) == {ti_id: ti_id for ti_id in ids}
    assert _resumes(sessions, ids) == dict.fromkeys(ids, 1)
    with sessions() as session:
        assert session.scalar(select(func.count()).select_from(SignalWait)) == 0


def test_cleared_waiter_leaves_its_key(
    settings: Settings, sessions: sessionmaker[Session], cipher: Cipher
) -> None:
    (ti_id,) = _running(sessions, 1)
    _wait(sessions, cipher, [(ti_id, "k")])
    with sessions.begin() as session:
        ti = session.get(TaskInstance, ti_id)
        assert ti is not None and transitions.clear(session, ti, retries=0)
    assert signals.send("k", None).resumed == ()
    with sessions() as session:
        assert session.get(TaskInstance, ti_id).state == TaskState.NONE  # type: ignore[union-attr]
        assert session.scalar(select(func.count()).select_from(SignalWait)) == 0


@pytest.mark.parametrize(
    ("key", "payload", "said"),
    [
        ("", None, "signal key '' is invalid: use a non-empty string"),
        ("x" * 201, None, "201 characters long, more than 200"),
        ("a b", None, "signal key 'a b' is invalid: use letters, digits"),
        ("ok", "x" * 70_000, "more than 65536"),
        ("ok", {1, 2}, "signal payload"),
    ],
)
def test_bad_sends_are_refused_in_one_line(
    settings: Settings, sessions: sessionmaker[Session], key: str, payload: Any, said: str
) -> None:
    with pytest.raises(SignalError, match=None) as raised:
        signals.send(key, payload)
    assert said in str(raised.value) and "\n" not in str(raised.value)
    with sessions() as session:
        assert session.scalar(select(func.count()).select_from(Signal)) == 0


def test_bad_api_and_cli_input_is_refused_in_one_line(
    settings: Settings, sessions: sessionmaker[Session]
) -> None:
    with web_client(settings, "0.0.0.0") as client:
        bad_key = client.post("/api/v1/signals/a%20b", json={}, headers=_basic())
        assert bad_key.status_code == 400 and "signal key 'a b'" in bad_key.json()["error"]
        too_big = client.post("/api/v1/signals/k", json={"payload": "x" * 70_000}, headers=_basic())
        assert too_big.status_code == 400 and "more than 65536" in too_big.json()["error"]
        assert client.post("/api/v1/signals/k", json={}).status_code == 401
    result = CliRunner().invoke(deferral_main, ["signals", "send", "k", "--payload", "{nope"])
    assert result.exit_code == 1 and result.output.startswith("error: --payload is not valid JSON")
    with sessions() as session:
        assert session.scalar(select(func.count()).select_from(Signal)) == 0


def test_bad_trigger_arguments_are_refused_where_the_dag_builds_them() -> None:
    with pytest.raises(SignalError, match="lookback must be a timedelta"):
        SignalTrigger("k", lookback=5)  # type: ignore[arg-type]
    with pytest.raises(SignalError, match="lookback 8 days, 0:00:00 is out of range"):
        SignalTrigger("k", lookback=dt.timedelta(days=8))
    assert signals.wait_of(SignalTrigger("k").serialize()[0], {"key": "a b"}, 1, 1) is None


# -- callback tokens ----------------------------------------------------------------------------


def _token(
    cipher: Cipher, ti_id: int, age: dt.timedelta = dt.timedelta(0), try_number: int = 1
) -> str:
    return make_token(cipher, ti_id, try_number, dt.datetime.now(dt.UTC) - age)


def _signals(sessions: sessionmaker[Session]) -> int:
    with sessions() as session:
        return session.scalar(select(func.count()).select_from(Signal)) or 0


def _changes(sessions: sessionmaker[Session]) -> int:
    with sessions() as session:
        return session.scalar(select(func.count()).select_from(TaskStateChange)) or 0


def test_callback_token_resumes_its_task_once_and_a_replay_changes_nothing(
    settings: Settings, sessions: sessionmaker[Session], cipher: Cipher
) -> None:
    mine, other = _running(sessions, 2)
    token = _token(cipher, mine)
    _defer(sessions, cipher, [(mine, CallbackTrigger(token)), (other, SignalTrigger("x"))])
    with web_client(settings, "0.0.0.0") as client:  # no login: the token is the credential
        url = f"/api/v1/callbacks/{token}"
        answer = client.post(url, json={"status": "success", "payload": {"paid": 42}})
        assert answer.status_code == 200 and answer.json() == {"resumed": 1}
        assert _events(sessions, cipher, [mine, other]) == {mine: {"paid": 42}}
        before = (_signals(sessions), _changes(sessions))
        again = client.post(url, json={"status": "success", "payload": "again"})
        assert again.status_code == 409 and again.json()["error"] == "callback token already used"
        assert (_signals(sessions), _changes(sessions)) == before
        assert _events(sessions, cipher, [mine]) == {mine: {"paid": 42}}


def test_forged_unknown_and_expired_tokens_are_refused(
    settings: Settings, sessions: sessionmaker[Session], cipher: Cipher
) -> None:
    (ti_id,) = _running(sessions, 1)
    token = _token(cipher, ti_id)
    _defer(sessions, cipher, [(ti_id, CallbackTrigger(token))])
    body, mac = token.rsplit(".", 1)
    forged = [
        f"{body}.{mac[:-1]}{'A' if mac[-1] != 'A' else 'B'}",  # the signature changed
        f"{ti_id + 1}{token[len(str(ti_id)) :]}",  # another task, same signature
        make_token(Cipher([Fernet.generate_key().decode()]), ti_id, 1, dt.datetime.now(dt.UTC)),
        "nonsense",
        "1.1.1.x." + "A" * 300,
    ]
    expired = _token(cipher, ti_id, age=dt.timedelta(days=8))
    with web_client(settings, "0.0.0.0") as client:
        for bad in forged:
            refused = client.post(f"/api/v1/callbacks/{bad}", json={"status": "success"})
            assert refused.status_code == 404, bad
            assert refused.json()["error"] == "unknown callback token"
        late = client.post(f"/api/v1/callbacks/{expired}", json={"status": "success"})
        assert late.status_code == 410 and "expired at" in late.json()["error"]
        for bad_body, said in (
            ({"status": "done"}, "status must be 'success' or 'failure'"),
            ({"status": "success", "payload": "x" * 70_000}, "more than 65536"),
            ([1], "the body must be a JSON object"),
        ):
            answer = client.post(f"/api/v1/callbacks/{token}", json=bad_body)
            assert answer.status_code == 400 and said in answer.json()["error"]
    assert _events(sessions, cipher, [ti_id]) == {} and _signals(sessions) == 0


def test_callback_token_of_a_cleared_task_is_refused(
    settings: Settings, sessions: sessionmaker[Session], cipher: Cipher
) -> None:
    (ti_id,) = _running(sessions, 1)
    token = _token(cipher, ti_id)
    _defer(sessions, cipher, [(ti_id, CallbackTrigger(token))])
    with sessions.begin() as session:
        ti = session.get(TaskInstance, ti_id)
        assert ti is not None and transitions.clear(session, ti, retries=0)
    with web_client(settings, "0.0.0.0") as client:
        refused = client.post(f"/api/v1/callbacks/{token}", json={"status": "success"})
    assert refused.status_code == 409 and "no longer waits" in refused.json()["error"]
    assert _signals(sessions) == 0


def test_failure_status_fails_the_task_with_the_payloads_message(
    settings: Settings, sessions: sessionmaker[Session], cipher: Cipher
) -> None:
    (ti_id,) = _running(sessions, 1)
    token = _token(cipher, ti_id)
    _defer(sessions, cipher, [(ti_id, CallbackTrigger(token))])
    with web_client(settings, "0.0.0.0") as client:
        answer = client.post(
            f"/api/v1/callbacks/{token}",
            json={"status": "failure", "payload": {"message": "card\ndeclined"}},
        )
    assert answer.status_code == 200
    with sessions() as session:
        ti = session.get(TaskInstance, ti_id)
        assert ti is not None and ti.state == TaskState.SCHEDULED
        assert ti.next_method == FAIL_METHOD and ti.next_kwargs is not None
        kwargs = cipher.open(Purpose.RESUME_KWARGS, ti.next_kwargs)
    assert kwargs["message"] == "callback reported failure: card declined"
    with pytest.raises(TaskDeferralError, match=r"^callback reported failure: card declined$"):
        raise deferral_failure(kwargs)


def test_callback_before_the_deferral_is_kept_for_it(
    settings: Settings, sessions: sessionmaker[Session], cipher: Cipher
) -> None:
    (ti_id,) = _running(sessions, 1)
    token = _token(cipher, ti_id)
    with web_client(settings, "0.0.0.0") as client:
        early = client.post(f"/api/v1/callbacks/{token}", json={"status": "success", "payload": 7})
    assert early.status_code == 200 and early.json() == {"resumed": 0}
    _defer(sessions, cipher, [(ti_id, CallbackTrigger(token))])
    assert _events(sessions, cipher, [ti_id]) == {ti_id: 7}


def test_callback_token_of_another_task_or_try_is_no_wait(cipher: Cipher) -> None:
    token = _token(cipher, 5)
    classpath, kwargs = CallbackTrigger(token).serialize()
    assert signals.wait_of(classpath, kwargs, 5, 1) is not None
    assert signals.wait_of(classpath, kwargs, 6, 1) is None
    assert signals.wait_of(classpath, kwargs, 5, 2) is None


def _run_again(sessions: sessionmaker[Session], ti_id: int) -> None:
    """End the running try of ``ti_id``, clear it and start its next try on WORKER."""
    with sessions.begin() as session:
        assert transitions.fail(session, Attempt(ti_id, 1, WORKER), "boom", allow_retry=False)
        ti = session.get(TaskInstance, ti_id)
        assert ti is not None and transitions.clear(session, ti, retries=0)
        transitions.schedule(session, [ti_id])
        transitions.dispatch(session, [ti_id])
        assert transitions.start_many(session, [(ti_id, 2)], "host", WORKER)


def test_a_token_of_an_earlier_try_neither_answers_nor_resumes_a_later_one(
    settings: Settings, sessions: sessionmaker[Session], cipher: Cipher
) -> None:
    """Whoever holds try 1's token (its answer kept, or unused) cannot resume try 2: the answer
    is refused, and try 2 waiting on that token is no wait (the triggerer fails it), so the
    answer kept for try 1 never reaches it. Try 2's own token still works."""
    (ti_id,) = _running(sessions, 1)
    answered_early, unused = _token(cipher, ti_id), _token(cipher, ti_id)
    with web_client(settings, "0.0.0.0") as client:
        early = client.post(
            f"/api/v1/callbacks/{answered_early}", json={"status": "success", "payload": "try 1"}
        )
        assert early.status_code == 200 and early.json() == {"resumed": 0}  # kept for try 1
        _run_again(sessions, ti_id)
        classpath, kwargs = CallbackTrigger(answered_early).serialize()
        assert signals.wait_of(classpath, kwargs, ti_id, 2) is None
        genuine = _token(cipher, ti_id, try_number=2)
        _defer(sessions, cipher, [(ti_id, CallbackTrigger(genuine))], try_number=2)
        assert _events(sessions, cipher, [ti_id]) == {}
        for earlier in (unused, answered_early):
            refused = client.post(f"/api/v1/callbacks/{earlier}", json={"status": "success"})
            assert refused.status_code == 409, refused.text
        assert _events(sessions, cipher, [ti_id]) == {}
        answer = client.post(
            f"/api/v1/callbacks/{genuine}", json={"status": "success", "payload": "try 2"}
        )
        assert answer.status_code == 200 and answer.json() == {"resumed": 1}
    assert _events(sessions, cipher, [ti_id]) == {ti_id: "try 2"}


def test_reconciler_and_doctor_leave_signal_waits_out_of_the_streams(
    settings: Settings, sessions: sessionmaker[Session], cipher: Cipher, broker: Broker
) -> None:
    waiting, plain = _running(sessions, 2)
    _wait(sessions, cipher, [(waiting, "k")])
    # A deferred task on an ordinary trigger that no stream holds: the one to republish.
    with sessions.begin() as session:
        trigger_id = transitions.create_trigger(
            session,
            "deferral.triggers.temporal.DateTimeTrigger",
            cipher.seal(Purpose.TRIGGER_KWARGS, {"moment": None}),
        )
        assert transitions.defer(
            session,
            Attempt(plain, 1, WORKER),
            trigger_id=trigger_id,
            next_method="resume",
            next_kwargs_token=cipher.seal(Purpose.RESUME_KWARGS, {}),
            trigger_timeout=None,
        )
        session.execute(text("UPDATE task_instance SET updated_at = now() - interval '1 hour'"))
    assert _not_in_flight(broker, settings) == ["signals_dag.r1.t1"]
    Reconciler(sessions, broker, cipher, settings.heartbeat_sec).reconcile()
    with sessions() as session:
        wait_trigger = str(session.scalar(select(SignalWait.trigger_id)))
    held = broker.present(broker.keys.triggers, [str(trigger_id), wait_trigger])
    assert held == {str(trigger_id): True, wait_trigger: False}


def test_signals_older_than_the_retention_are_pruned_by_later_sends(
    settings: Settings, sessions: sessionmaker[Session]
) -> None:
    old, recent = signals.send("k", "old"), signals.send("k", "recent")
    with sessions.begin() as session:
        session.execute(
            text("UPDATE signal SET sent_at = now() - interval '8 days' WHERE id = :id"),
            {"id": old.id},
        )
    new = signals.send("other", "new")
    with sessions() as session:
        kept = set(session.scalars(select(Signal.id)))
    assert kept == {recent.id, new.id}


def test_without_lookback_only_later_signals_count_and_a_timeout_ends_the_wait(
    settings: Settings, sessions: sessionmaker[Session], cipher: Cipher
) -> None:
    late, timed_out = _running(sessions, 2)
    signals.send("k", "before")  # a moment before the wait: not seen without a lookback
    _wait(sessions, cipher, [(late, "k"), (timed_out, "t")])
    assert _events(sessions, cipher, [late]) == {}
    with sessions.begin() as session:
        session.execute(
            text(
                "UPDATE task_instance SET trigger_timeout = now() - interval '1 s' WHERE id = :id"
            ),
            {"id": timed_out},
        )
        assert transitions.expire_deferrals(session, cipher) == [timed_out]
    assert signals.send("t", "too late").resumed == ()
    assert signals.send("k", "after").resumed == (late,)
    assert _events(sessions, cipher, [late]) == {late: "after"}
    with sessions() as session:
        assert session.scalar(select(func.count()).select_from(SignalWait)) == 0


def test_a_signal_wait_is_shown_as_such_not_as_an_unpicked_trigger(
    settings: Settings, sessions: sessionmaker[Session], cipher: Cipher
) -> None:
    on_signal, on_callback = _running(sessions, 2)
    _wait(sessions, cipher, [(on_signal, "orders:42")])
    _defer(sessions, cipher, [(on_callback, CallbackTrigger(_token(cipher, on_callback)))])
    with sessions() as session:
        run = session.scalars(select(DagRun)).one()
        lines = {
            ti_id: explain(session, settings, None, run, session.get_one(TaskInstance, ti_id))
            for ti_id in (on_signal, on_callback)
        }
    assert "  resumed by a signal sent to key 'orders:42'" in "\n".join(lines[on_signal])
    assert "resumed by a POST of its answer to its callback URL" in "\n".join(lines[on_callback])
    assert not any("picked" in line for line in lines[on_signal] + lines[on_callback])

    with web_client(settings, "127.0.0.1") as client:
        page = client.get(
            "/dags/signals_dag/task_instance?run_id=r1&task_id=t0", headers=_basic()
        ).text
        assert 'id="resumed-by"' in page and "deferral signals send orders:42" in page
        assert "not picked up yet" not in page
        deferred = client.get("/deferred", headers=_basic()).text
        assert "a signal resumes them" in deferred and "a callback resumes them" in deferred
        assert "no triggerer yet" not in deferred


def test_a_callback_that_stops_heartbeating_fails_its_task_and_one_that_beats_waits_on(
    settings: Settings, sessions: sessionmaker[Session], cipher: Cipher
) -> None:
    beating, silent, plain = _running(sessions, 3)
    every = dt.timedelta(minutes=5)
    tokens = {ti: _token(cipher, ti) for ti in (beating, silent, plain)}
    _defer(
        sessions,
        cipher,
        [
            (beating, CallbackTrigger(tokens[beating], heartbeat=every)),
            (silent, CallbackTrigger(tokens[silent], heartbeat=every)),
            (plain, CallbackTrigger(tokens[plain])),
        ],
    )
    with sessions() as session:
        ti = session.get_one(TaskInstance, beating)
        run = session.scalars(select(DagRun).where(DagRun.run_id == "r1")).one()
        said = "\n".join(explain(session, settings, None, run, ti))
    assert "heartbeat every 0:05:00: the next due by " in said
    with web_client(settings, "0.0.0.0") as client:  # no login: the token is the credential
        beat = client.post(f"/api/v1/callbacks/{tokens[beating]}/heartbeat")
        assert beat.status_code == 200 and "next_heartbeat_by" in beat.json()
        no_beat = client.post(f"/api/v1/callbacks/{tokens[plain]}/heartbeat")
        assert no_beat.status_code == 409 and "no heartbeat is awaited" in no_beat.json()["error"]
        forged = client.post(f"/api/v1/callbacks/{tokens[silent][:-2]}xx/heartbeat")
        assert forged.status_code == 404 and forged.json()["error"] == "unknown callback token"
        # The silent one's interval passes (its deadline moved back instead of waiting it out).
        with sessions.begin() as session:
            session.execute(
                text(
                    "UPDATE callback_heartbeat SET due_at = now() - interval '1 second'"
                    " FROM task_instance AS ti"
                    " WHERE ti.id = :id AND ti.trigger_id = callback_heartbeat.trigger_id"
                ),
                {"id": silent},
            )
        with sessions.begin() as session:
            assert waits.fail_missed_heartbeats(session, cipher) == [silent]
        late = client.post(f"/api/v1/callbacks/{tokens[silent]}/heartbeat")
        assert late.status_code == 409
    with sessions() as session:
        states = dict(
            session.execute(
                select(TaskInstance.id, TaskInstance.state).where(
                    TaskInstance.id.in_([beating, silent, plain])
                )
            ).all()
        )
        failed = session.get(TaskInstance, silent)
        assert failed is not None and failed.next_method == FAIL_METHOD
        assert failed.next_kwargs is not None
        kwargs = cipher.open(Purpose.RESUME_KWARGS, failed.next_kwargs)
    assert states == {beating: "deferred", silent: "scheduled", plain: "deferred"}
    assert kwargs["message"] == (
        "callback heartbeat missed: no heartbeat posted within 0:05:00"
        " (CallbackTrigger(heartbeat=datetime.timedelta(seconds=300)))"
    )


def test_dags_trigger_wait_tells_how_each_waiting_task_is_resumed(
    sessions: sessionmaker[Session], cipher: Cipher
) -> None:
    """`dags trigger --wait` shows, under a task waiting on a signal, the command that sends it;
    under a task awaiting input, the one that answers it; nothing under a task whose trigger
    runs in a triggerer."""
    on_signal, on_timer, asking = _running(sessions, 3)
    _wait(sessions, cipher, [(on_signal, "orders-paid")])
    defer_running(sessions, cipher, on_timer)
    with sessions.begin() as session:
        assert transitions.await_input(session, Attempt(asking, 1, WORKER))

    with sessions() as session:
        status = read_status(session, "signals_dag", "r1")
    assert [(t.task, t.state, t.resumed_by) for t in status.tasks] == [
        (
            "t0",
            "deferred",
            "a signal sent to key 'orders-paid'"
            " (`deferral signals send orders-paid --payload JSON`)",
        ),
        ("t1", "deferred", ""),
        (
            "t2",
            "awaiting_input",
            f"an answer: `deferral approvals respond {asking} <option>` (its question and options:"
            " `deferral approvals list`)",
        ),
    ]
