"""API tokens for machines: made, listed and revoked with ``deferral tokens``, scoped, checked by
an HMAC against their row on every request (no argon2), refused at once when revoked."""

from __future__ import annotations

from typing import Any

import pytest
from click.testing import CliRunner
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from deferral.runtime.config import Settings
from deferral.runtime.crypto import Cipher
from deferral.store.tables import ApiToken, DagRun, Signal
from deferral.triggers.signal import CallbackTrigger
from deferral_cli import main as deferral_main
from tests.integration.conftest import web_client
from tests.integration.test_signals import _defer, _running, _token
from webserver import users


def _make(name: str, *scopes: str) -> str:
    args = ["tokens", "create", name, *(a for s in scopes for a in ("--scope", s))]
    made = CliRunner().invoke(deferral_main, args)
    assert made.exit_code == 0, made.output
    return made.stdout.strip()


def _bearer(token: str) -> dict[str, str]:
    return {"authorization": f"Bearer {token}"}


class _NoArgon2:
    def verify(self, *args: Any) -> None:
        raise AssertionError("an API token is never checked with argon2")


def test_a_token_acts_within_its_scopes_and_is_refused_once_revoked(
    settings: Settings,
    sessions: sessionmaker[Session],
    web_dag: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    token = _make("relay-bot", "signals", "signals")
    assert token.startswith("dfr_") and len(token) > 45
    with sessions() as session:
        row = session.scalars(select(ApiToken)).one()
    assert (row.name, row.scopes) == ("relay-bot", ["signals"])
    assert token.split("_", 2)[2] not in row.digest  # the secret (which may hold "_" itself)
    listed = CliRunner().invoke(deferral_main, ["tokens", "list", "--output", "json"])
    assert '"scopes": [\n      "signals"\n    ]' in listed.output and "dfr_" not in listed.output
    monkeypatch.setattr(users, "_hasher", _NoArgon2())
    with web_client(settings, "0.0.0.0") as client:
        sent = client.post("/api/v1/signals/k", json={"payload": 1}, headers=_bearer(token))
        assert sent.status_code == 201, sent.text
        with sessions() as session:
            assert session.scalar(select(Signal.sent_by)) == "token:relay-bot"
        # Another scope, a read, an action no token may take: 403 naming why.
        run = client.post(f"/api/v1/dags/{web_dag}/runs", json={}, headers=_bearer(token))
        assert run.status_code == 403
        assert run.json() == {"error": "API token 'relay-bot' lacks the 'runs' scope"}
        for refused in (
            client.get("/api/v1/dags", headers=_bearer(token)),
            client.post(f"/api/v1/dags/{web_dag}/pause", json={}, headers=_bearer(token)),
        ):
            assert refused.status_code == 403
            assert refused.json()["error"] == (
                "API tokens are for signals, callbacks, runs only: this path needs a login"
            )
        forged = token[:-4] + ("aaaa" if not token.endswith("aaaa") else "bbbb")
        for wrong in (forged, "dfr_999_" + "a" * 43, "nonsense", ""):
            answer = client.post("/api/v1/signals/k", json={}, headers=_bearer(wrong))
            assert answer.status_code == 401
            assert answer.json()["error"] == "API token unknown, revoked or malformed"
        revoked = CliRunner().invoke(deferral_main, ["tokens", "revoke", "relay-bot"])
        assert revoked.exit_code == 0 and revoked.output == "token relay-bot revoked\n"
        after = client.post("/api/v1/signals/k", json={}, headers=_bearer(token))
        assert after.status_code == 401
    with sessions() as session:
        assert session.scalar(select(DagRun.id)) is None


def test_runs_and_callbacks_scopes_and_the_per_token_rate(
    settings: Settings, sessions: sessionmaker[Session], cipher: Cipher, web_dag: str
) -> None:
    runs, relay = _make("runner", "runs"), _make("relay", "callbacks", "signals")
    (ti_id,) = _running(sessions, 1)
    callback = _token(cipher, ti_id)
    _defer(sessions, cipher, [(ti_id, CallbackTrigger(callback))])
    with web_client(settings, "0.0.0.0", {"DEFERRAL_WEBSERVER_SIGNAL_RATE": "2/minute"}) as client:
        made = client.post(
            f"/api/v1/dags/{web_dag}/runs", json={"run_id": "by-token"}, headers=_bearer(runs)
        )
        assert made.status_code == 201 and made.json()["run_id"] == "by-token"
        url = f"/api/v1/callbacks/{callback}"
        body = {"status": "success"}
        lacking = client.post(url, json=body, headers=_bearer(runs))
        assert lacking.status_code == 403 and "lacks the 'callbacks' scope" in lacking.text
        assert client.post(url, json=body, headers=_bearer(relay)).json() == {"resumed": 1}
        # The relay's callback answer and its signals share its rate: 2 a minute.
        assert client.post("/api/v1/signals/k", json={}, headers=_bearer(relay)).status_code == 201
        limited = client.post("/api/v1/signals/k", json={}, headers=_bearer(relay))
        assert limited.status_code == 429 and "retry-after" in limited.headers


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (
            ["create", "bot", "--scope", "admin"],
            "unknown scope 'admin': use signals, callbacks, runs",
        ),
        (["create", "bot"], "give at least one --scope: signals, callbacks, runs"),
        (["create", "a b", "--scope", "runs"], "token name 'a b' is invalid"),
        (["create", "x" * 51, "--scope", "runs"], "is invalid: use 1-50 letters"),
        (["revoke", "nobody"], "no API token 'nobody'"),
    ],
)
def test_bad_token_commands_are_refused_in_one_line(
    settings: Settings, sessions: sessionmaker[Session], args: list[str], said: str
) -> None:
    result = CliRunner().invoke(deferral_main, ["tokens", *args])
    assert result.exit_code == 1 and said in result.output, result.output
    assert len(result.output.strip().splitlines()) == 1


def test_a_taken_name_is_refused(settings: Settings, sessions: sessionmaker[Session]) -> None:
    _make("twice", "runs")
    again = CliRunner().invoke(deferral_main, ["tokens", "create", "twice", "--scope", "runs"])
    assert again.exit_code == 1 and again.output == "error: token 'twice' exists already\n"
