"""Signals sent through the API are written in batches (``webserver.signalbatch``): each send
keeps its own answer, a repeated idempotency key acts once within one batch, a refused send
leaves the others be, and a token revoked since it was verified is refused by the batch's
transaction, in every webserver replica that remembers it."""

from __future__ import annotations

from click.testing import CliRunner
from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

from deferral import signals
from deferral.runtime.config import Settings
from deferral.runtime.crypto import Cipher
from deferral.store.tables import ResumeEvent, Signal, TaskInstance
from deferral.triggers import SignalTrigger
from deferral_cli import main as deferral_main
from tests.integration.conftest import web_client
from tests.integration.test_api_tokens import _bearer, _make
from tests.integration.test_signals import _defer, _running
from tests.integration.test_webserver import _requests
from webserver import tokens
from webserver.signalbatch import Send, SignalBatches


def _sent(sessions: sessionmaker[Session], key: str) -> int:
    with sessions() as session:
        return session.scalar(select(func.count()).where(Signal.key == key)) or 0


def test_a_batch_answers_each_send_on_its_own(
    settings: Settings, sessions: sessionmaker[Session], cipher: Cipher
) -> None:
    waiting, filtered = _running(sessions, 2)
    _defer(
        sessions,
        cipher,
        [(waiting, SignalTrigger("go")), (filtered, SignalTrigger("f", where={"n": 2}))],
    )
    with sessions.begin() as session:
        token = tokens.create_token(session, cipher, "gone", [tokens.SIGNALS])
        assert token is not None
        token_id = int(token.split("_")[1])
        assert tokens.revoke_token(session, "gone")
    woken: list[int] = []
    batches = SignalBatches(sessions, cipher, lambda: woken.append(1))
    user = signals.Sender("token:bot", 100)
    outcomes = batches.write(
        [
            Send("go", {"n": 1}, user, "once", None),
            Send("go", {"n": 1}, user, "once", None),  # a repeat in the same batch
            Send("go", {"n": 1}, user, "once", 999),  # a token revoked since it was verified
            Send("bad", {1, 2}, user, None, None),  # not JSON: refused alone
            Send("go", {"n": 2}, user, "once", None),  # the key reused for another send
            Send("f", {"n": 1}, user, None, None),  # the filter does not match
            Send("f", {"n": 2}, user, None, token_id),  # revoked
        ]
    )
    first, repeat, revoked, bad, conflict, unmatched, gone = outcomes
    assert isinstance(first, signals.SentSignal) and first.resumed == (waiting,)
    assert isinstance(repeat, signals.SentSignal) and repeat.replayed
    assert (repeat.id, repeat.resumed) == (first.id, first.resumed)
    assert isinstance(revoked, tokens.Revoked) and isinstance(gone, tokens.Revoked)
    assert isinstance(bad, signals.SignalError) and "signal payload" in str(bad)
    assert isinstance(conflict, signals.IdempotencyConflict)
    assert isinstance(unmatched, signals.SentSignal) and unmatched.resumed == ()
    assert (_sent(sessions, "go"), _sent(sessions, "f"), _sent(sessions, "bad")) == (1, 1, 0)
    with sessions() as session:
        states = {
            r.id: r.state for r in session.execute(select(TaskInstance.id, TaskInstance.state))
        }
    assert states == {waiting: "scheduled", filtered: "deferred"}
    assert woken == [1]  # once for the batch


def test_a_token_revoked_is_refused_at_once_by_every_replica_remembering_it(
    settings: Settings, sessions: sessionmaker[Session]
) -> None:
    token = _make("relay", "signals")
    with web_client(settings, "0.0.0.0") as one, web_client(settings, "0.0.0.0") as two:
        for replica in (one, two, one, two):  # each has verified it and remembers it
            sent = replica.post("/api/v1/signals/k", json={"payload": 1}, headers=_bearer(token))
            assert sent.status_code == 201, sent.text
            assert sent.headers["cache-control"] == "no-store"
            assert sent.headers["x-frame-options"] == "DENY"
        revoked = CliRunner().invoke(deferral_main, ["tokens", "revoke", "relay"])
        assert revoked.exit_code == 0, revoked.output
        for replica in (one, two, one):
            refused = replica.post("/api/v1/signals/k", json={"payload": 1}, headers=_bearer(token))
            assert refused.status_code == 401
            assert refused.json() == {"error": "API token unknown, revoked or malformed"}
    assert _sent(sessions, "k") == 4


def test_a_token_request_past_the_browser_layers_keeps_the_api_answers(
    settings: Settings, sessions: sessionmaker[Session]
) -> None:
    token = _make("edge", "signals")
    counted = _requests("POST", "/api/v1/signals/{key}", "415")
    with web_client(settings, "0.0.0.0") as client:
        cases = [
            (client.post("/api/v1/signals/k", content=b"{}", headers=_bearer(token)), 415),
            (
                client.post(
                    "/api/v1/signals/k",
                    content=b"x" * (1024 * 1024 + 1),
                    headers={**_bearer(token), "content-type": "application/json"},
                ),
                413,
            ),
            (client.post("/api/v1/signals/k", json=[1], headers=_bearer(token)), 400),
            (client.post("/api/v1/signals/a%20b", json={}, headers=_bearer(token)), 400),
            (client.post("/api/v1/signals/k?x=%ff", json={}, headers=_bearer(token)), 400),
            (client.post("/api/v1/signals/k", json={}, headers=_bearer("dfr_1_x")), 401),
        ]
        for answer, status in cases:
            assert answer.status_code == status, answer.text
            assert "\n" not in answer.text.strip()
            if status != 413:  # the body limit answers that one itself, as on every path
                assert list(answer.json()) == ["error"]
                assert answer.headers["cache-control"] == "no-store"
        assert "signal key 'a b' is invalid" in cases[3][0].json()["error"]
        # Counted under its route's pattern, as the router would have named it.
        assert _requests("POST", "/api/v1/signals/{key}", "415") == counted + 1
    allowed = {"DEFERRAL_WEBSERVER_ALLOWED_HOSTS": "deferral.example"}
    with web_client(settings, "0.0.0.0", allowed) as client:
        bad_host = client.post(
            "/api/v1/signals/k", json={}, headers={**_bearer(token), "host": "evil.example"}
        )
        assert bad_host.status_code == 400 and "bad Host header" in bad_host.text
    assert _sent(sessions, "k") == 0


def test_a_batchs_sends_to_one_key_act_in_order_and_keep_the_senders_quota(
    settings: Settings, sessions: sessionmaker[Session], cipher: Cipher
) -> None:
    (waiting,) = _running(sessions, 1)
    _defer(sessions, cipher, [(waiting, SignalTrigger("twice"))])
    user = signals.Sender("token:bot", 2)
    first, second, other = SignalBatches(sessions, cipher, lambda: None).write(
        [
            Send("twice", 1, user, None, None),
            Send("twice", 2, user, None, None),  # after the first: finds its waiter resumed
            Send("other", 3, user, None, None),
        ]
    )
    assert isinstance(first, signals.SentSignal) and first.resumed == (waiting,)
    assert isinstance(second, signals.SentSignal) and second.resumed == ()
    assert isinstance(other, signals.SentSignal) and other.resumed == ()
    with sessions() as session:
        kept = session.scalars(
            select(Signal.id).where(Signal.sent_by == "token:bot").order_by(Signal.id)
        ).all()
        events = session.execute(
            select(ResumeEvent.dedup_key, ResumeEvent.trigger_id, ResumeEvent.outcome)
        ).all()
    assert kept == [second.id, other.id]  # the sender's newest two
    # The second did not find the wait at all (not even as a stale event).
    assert [(e.dedup_key, e.outcome) for e in events] == [
        (f"signal:{first.id}:{events[0].trigger_id}", "applied")
    ]


def test_a_batch_recorded_is_answered_as_recorded_when_no_scheduler_can_be_woken(
    settings: Settings, sessions: sessionmaker[Session], cipher: Cipher
) -> None:
    (waiting,) = _running(sessions, 1)
    _defer(sessions, cipher, [(waiting, SignalTrigger("woken"))])

    def wake() -> None:
        raise ConnectionError("Redis is away")

    user = signals.Sender("token:bot", 100)
    (sent,) = SignalBatches(sessions, cipher, wake).write([Send("woken", 1, user, None, None)])
    # Committed: a scheduler's next pass queues it; an error would make the caller send again.
    assert isinstance(sent, signals.SentSignal) and sent.resumed == (waiting,)
    assert _sent(sessions, "woken") == 1
