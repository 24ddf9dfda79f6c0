"""Idempotency keys against the real PostgreSQL: signals (library, CLI, API), callback answers and
triggered runs (CLI, API) act once per key, also under a hundred concurrent repeats."""

from __future__ import annotations

import base64
import datetime as dt
import threading
from collections.abc import Callable
from typing import Any

import pytest
from click.testing import CliRunner
from sqlalchemy import func, select, text
from sqlalchemy.orm import Session, sessionmaker

from deferral import signals
from deferral.runtime.config import Settings
from deferral.runtime.crypto import Cipher
from deferral.store import idempotency
from deferral.store.db import make_engine, make_sessionmaker
from deferral.store.tables import DagRun, IdempotencyKey, Signal
from deferral.triggers.signal import CallbackTrigger
from deferral_cli import main as deferral_main
from tests.integration.conftest import WEB_ADMIN_PASSWORD, web_client
from tests.integration.test_signals import _defer, _events, _resumes, _running, _token, _wait

REPEATS = 100
# Rate limits out of the way: a hundred repeats at once are what is tested here.
UNLIMITED = {
    "DEFERRAL_WEBSERVER_SIGNAL_RATE": "100000/second",
    "DEFERRAL_WEBSERVER_RUN_RATE": "100000/second",
}


def _basic() -> dict[str, str]:
    encoded = base64.b64encode(f"admin:{WEB_ADMIN_PASSWORD}".encode()).decode()
    return {"authorization": f"Basic {encoded}"}


def _count(sessions: sessionmaker[Session], table: type[Any]) -> int:
    with sessions() as session:
        return session.scalar(select(func.count()).select_from(table)) or 0


def _at_once(count: int, call: Callable[[], Any]) -> list[Any]:
    """``call()`` from ``count`` threads released together; their results."""
    barrier = threading.Barrier(count)
    results: list[Any] = [None] * count

    def one(i: int) -> None:
        barrier.wait()
        try:
            results[i] = call()
        except Exception as exc:  # the assertion below shows it
            results[i] = exc

    threads = [threading.Thread(target=one, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results


def test_hundred_concurrent_repeats_of_a_signal_send_one_signal_and_resume_once(
    settings: Settings, sessions: sessionmaker[Session], cipher: Cipher
) -> None:
    (ti_id,) = _running(sessions, 1)
    _wait(sessions, cipher, [(ti_id, "order-7")])
    # The server's connections are shared with other tests: the hundred take turns on sixteen.
    engine = make_engine(settings.database_url, pool_size=16, max_overflow=0)
    many = make_sessionmaker(engine)

    def send() -> signals.SentSignal:
        with many.begin() as session:
            return signals.send_in(session, cipher, "order-7", {"paid": 7}, idempotency_key="k-1")

    try:
        sent = _at_once(REPEATS, send)
    finally:
        engine.dispose()
    assert all(isinstance(s, signals.SentSignal) for s in sent), sent
    first = [s for s in sent if not s.replayed]
    assert len(first) == 1 and first[0].resumed == (ti_id,)
    assert {(s.id, s.key, s.resumed) for s in sent} == {(first[0].id, "order-7", (ti_id,))}
    assert _count(sessions, Signal) == 1
    assert _resumes(sessions, [ti_id]) == {ti_id: 1}
    assert _events(sessions, cipher, [ti_id]) == {ti_id: {"paid": 7}}
    # The library and the CLI share the key's scope; another payload under it is refused.
    again = signals.send("order-7", {"paid": 7}, idempotency_key="k-1")
    assert again.replayed and again.id == first[0].id
    with pytest.raises(signals.IdempotencyConflict, match="idempotency key 'k-1' was used"):
        signals.send("order-7", {"paid": 8}, idempotency_key="k-1")
    cli = CliRunner().invoke(
        deferral_main,
        ["signals", "send", "order-7", "--payload", '{"paid": 7}', "--idempotency-key", "k-1"],
    )
    assert cli.exit_code == 0 and "before with this idempotency key" in cli.output, cli.output
    cli = CliRunner().invoke(
        deferral_main, ["signals", "send", "other", "--idempotency-key", "k-1"]
    )
    assert cli.exit_code == 1 and cli.output.startswith("error: idempotency key 'k-1' was used")
    assert len(cli.output.strip().splitlines()) == 1
    assert _count(sessions, Signal) == 1


def test_hundred_concurrent_api_triggers_under_one_key_make_one_run(
    settings: Settings, sessions: sessionmaker[Session], web_dag: str
) -> None:
    with web_client(settings, "0.0.0.0", UNLIMITED) as client:

        def trigger() -> Any:
            return client.post(
                f"/api/v1/dags/{web_dag}/runs",
                json={"conf": {"n": 1}},
                headers={**_basic(), "Idempotency-Key": "nightly-2026-12-07"},
            )

        answers = _at_once(REPEATS, trigger)
        assert {a.status_code for a in answers} == {201}, [a.text for a in answers][:3]
        bodies = {a.text for a in answers}
        assert len(bodies) == 1
        assert sum(a.headers.get("idempotent-replayed") == "true" for a in answers) == REPEATS - 1
        conflict = client.post(
            f"/api/v1/dags/{web_dag}/runs",
            json={"conf": {"n": 2}},
            headers={**_basic(), "Idempotency-Key": "nightly-2026-12-07"},
        )
        assert conflict.status_code == 409
        assert "idempotency key 'nightly-2026-12-07' was used" in conflict.json()["error"]
    with sessions() as session:
        runs = session.scalars(select(DagRun.run_id).where(DagRun.dag_id == web_dag)).all()
    assert len(runs) == 1 and runs[0] in bodies.pop()
    # The command line's key is its own (no web user): it makes one run of its own, once.
    for _ in range(2):
        cli = CliRunner().invoke(
            deferral_main, ["dags", "trigger", web_dag, "--idempotency-key", "nightly-2026-12-07"]
        )
        assert cli.exit_code == 0, cli.output
    assert "triggered before with this idempotency key" in cli.output
    assert _count(sessions, DagRun) == 2


def test_api_signal_key_repeat_conflict_and_bad_keys(
    settings: Settings, sessions: sessionmaker[Session]
) -> None:
    with web_client(settings, "0.0.0.0", UNLIMITED) as client:

        def send(payload: Any, key: str) -> Any:
            headers = {**_basic(), "Idempotency-Key": key}
            return client.post("/api/v1/signals/k", json={"payload": payload}, headers=headers)

        first, again = send(1, "a"), send(1, "a")
        assert first.status_code == again.status_code == 201
        assert first.json() == again.json() and again.headers["idempotent-replayed"] == "true"
        assert "idempotent-replayed" not in first.headers
        conflict = send(2, "a")
        assert conflict.status_code == 409 and "idempotency key 'a'" in conflict.json()["error"]
        empty, long = send(1, ""), send(1, "x" * 256)
        assert empty.status_code == 400 and "idempotency key is empty" in empty.json()["error"]
        assert long.status_code == 400 and "256 characters long" in long.json()["error"]
    assert _count(sessions, Signal) == 1
    cli = CliRunner().invoke(deferral_main, ["signals", "send", "k", "--idempotency-key", ""])
    assert cli.exit_code == 1 and cli.output == (
        "error: the idempotency key is empty: give 1-255 printable characters\n"
    )


def test_a_callback_repeated_under_its_key_answers_as_the_first_did(
    settings: Settings, sessions: sessionmaker[Session], cipher: Cipher
) -> None:
    (ti_id,) = _running(sessions, 1)
    token = _token(cipher, ti_id)
    _defer(sessions, cipher, [(ti_id, CallbackTrigger(token))])
    url = f"/api/v1/callbacks/{token}"
    body = {"status": "success", "payload": {"paid": 1}}
    with web_client(settings, "0.0.0.0") as client:
        first = client.post(url, json=body, headers={"Idempotency-Key": "cb"})
        again = client.post(url, json=body, headers={"Idempotency-Key": "cb"})
        assert first.json() == again.json() == {"resumed": 1}
        assert again.headers["idempotent-replayed"] == "true"
        other = client.post(url, json={"status": "failure"}, headers={"Idempotency-Key": "cb"})
        assert other.status_code == 409 and "idempotency key 'cb'" in other.json()["error"]
        # Without the key, a second answer is a second use of the token, as before.
        assert client.post(url, json=body).status_code == 409
    assert _resumes(sessions, [ti_id]) == {ti_id: 1}


def test_a_key_past_its_window_acts_again_and_expired_keys_are_swept(
    settings: Settings, sessions: sessionmaker[Session], cipher: Cipher
) -> None:
    acted: list[int] = []

    def act() -> dict[str, Any]:
        acted.append(1)
        return {"n": len(acted)}

    with sessions.begin() as session:
        session.execute(
            text(
                "INSERT INTO idempotency_key (scope, key, fingerprint, answer, created_at)"
                " SELECT 'old', 'k' || i, '', '{}', now() - interval '2 days'"
                " FROM generate_series(1, 150) AS i"
            )
        )
    made = idempotency.Request("test", "k", {"a": 1})

    def claim(window: dt.timedelta) -> dict[str, Any]:
        with sessions.begin() as session:
            return idempotency.once(session, cipher, made, act, window).answer

    def old_keys() -> int:
        with sessions() as session:
            old = select(func.count()).where(IdempotencyKey.scope == "old")
            return session.scalar(old) or 0

    day = dt.timedelta(days=1)
    assert claim(day) == {"n": 1}
    # Each claim sweeps up to SWEEP_PER_CLAIM expired keys of any scope.
    assert old_keys() == 150 - idempotency.SWEEP_PER_CLAIM
    assert claim(day) == {"n": 1}
    assert old_keys() == 0
    assert claim(dt.timedelta(0)) == {"n": 2}  # past its window: a new first request
    assert acted == [1, 1]
