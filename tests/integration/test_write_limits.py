"""Writes that store something on a caller's say, against the real PostgreSQL: signals and
triggered runs are rate limited per user (and callback answers per token) with 429 and
Retry-After, one user's flood leaves the others their rate, the signals a user keeps are bounded
whatever they send, and oversized payloads are refused in one line. Low limits are set through
the settings' environment to keep the test short."""

from __future__ import annotations

import datetime as dt
import json
from collections import Counter
from collections.abc import Iterator
from typing import Any

import anyio
import pytest
from click.testing import CliRunner
from sqlalchemy import func, select, update
from sqlalchemy.orm import Session, sessionmaker
from starlette.testclient import TestClient

from deferral import signals
from deferral.runtime.config import Settings
from deferral.runtime.crypto import Cipher
from deferral.store.callback_tokens import make_token
from deferral.store.db import make_engine, make_sessionmaker
from deferral.store.tables import DagRun, Signal, SignalCount
from deferral.triggers.signal import SIGNAL_RETENTION
from deferral_cli import main as deferral_main
from tests.integration.conftest import web_client
from tests.integration.test_idempotency import _at_once
from tests.integration.test_webserver import ADMIN_PASSWORD, WEB_DAG, basic, csrf_of, log_in
from webserver import users

pytestmark = pytest.mark.usefixtures("web_dag")

SENDS = 10_000
LIMITS = {
    "DEFERRAL_WEBSERVER_SIGNAL_RATE": "200/hour",
    "DEFERRAL_WEBSERVER_RUN_RATE": "3/hour",
    "DEFERRAL_WEBSERVER_SIGNALS_KEPT_PER_USER": "50",
}
JSON = {"content-type": "application/json"}


@pytest.fixture
def limited(settings: Settings, sessions: sessionmaker[Session]) -> Iterator[TestClient]:
    with sessions.begin() as session:
        users.create_user(session, "other", "other-password-1")
    with web_client(settings, "0.0.0.0", LIMITS) as client:
        yield client


def _stored(sessions: sessionmaker[Session], sender: str | None = None) -> int:
    with sessions() as session:
        query = select(func.count()).select_from(Signal)
        if sender is not None:
            query = query.where(Signal.sent_by == sender)
        return int(session.scalar(query) or 0)


async def _post(
    app: Any, path: str, body: bytes, headers: dict[str, str]
) -> tuple[int, dict[str, str], bytes]:
    """One POST straight through the ASGI app (a TestClient request costs milliseconds of its
    own, a minute for 10,000): status, headers, body."""
    scope = {
        "type": "http",
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [(k.encode(), v.encode()) for k, v in {**headers, "host": "localhost"}.items()],
        "client": ("127.0.0.1", 50000),
        "server": ("127.0.0.1", 8080),
    }
    sent = False
    answer: dict[str, Any] = {"body": b""}

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if sent:
            await anyio.sleep_forever()
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            answer["status"] = message["status"]
            answer["headers"] = {k.decode(): v.decode() for k, v in message["headers"]}
        elif message["type"] == "http.response.body":
            answer["body"] += message.get("body", b"")

    await app(scope, receive, send)
    return answer["status"], answer["headers"], answer["body"]


def test_ten_thousand_signals_from_one_user_are_throttled_and_storage_stays_bounded(
    limited: TestClient, sessions: sessionmaker[Session]
) -> None:
    auth = {**basic("admin", ADMIN_PASSWORD), **JSON}
    statuses: Counter[int] = Counter()
    refusals: list[tuple[dict[str, str], bytes]] = []

    async def flood() -> None:
        for n in range(SENDS):
            body = json.dumps({"payload": n}).encode()
            status, headers, said = await _post(
                limited.app, f"/api/v1/signals/flood-{n}", body, auth
            )
            statuses[status] += 1
            if status == 429 and not refusals:
                refusals.append((headers, said))

    anyio.run(flood)
    assert statuses == {201: 200, 429: SENDS - 200}, statuses
    ((headers, said),) = refusals
    assert json.loads(said)["error"].startswith("too many signals: at most 200 per 1 hour;")
    assert 1 <= int(headers["retry-after"]) <= 3600
    # Storage: the user's newest 50 are kept, whatever they sent.
    assert _stored(sessions, "admin") == 50
    with sessions() as session:
        kept = sorted(session.scalars(select(Signal.key)))
    assert kept == sorted(f"flood-{n}" for n in range(150, 200))
    # Another user's rate is their own.
    other = {**basic("other", "other-password-1"), **JSON}
    assert limited.post("/api/v1/signals/k", json={}, headers=other).status_code == 201
    # The library and the CLI (database credentials: trusted) are neither limited nor counted.
    result = CliRunner().invoke(deferral_main, ["signals", "send", "from-cli"])
    assert result.exit_code == 0, result.output
    assert _stored(sessions) == 52 and _stored(sessions, "other") == 1


def test_triggered_runs_are_throttled_per_user_on_the_api_and_the_form(
    limited: TestClient, sessions: sessionmaker[Session]
) -> None:
    auth = {**basic("admin", ADMIN_PASSWORD), **JSON}
    path = f"/api/v1/dags/{WEB_DAG}/runs"
    statuses = [
        limited.post(path, json={"run_id": f"r{n}"}, headers=auth).status_code for n in range(5)
    ]
    assert statuses == [201, 201, 201, 429, 429]
    refused = limited.post(path, json={"run_id": "late"}, headers=auth)
    assert refused.json()["error"].startswith("too many runs: at most 3 per 1 hour;")
    assert int(refused.headers["retry-after"]) >= 1
    log_in(limited)  # the form counts for the same user
    token = csrf_of(limited, f"/dags/{WEB_DAG}")
    page = limited.post(f"/dags/{WEB_DAG}/trigger", data={"conf": "{}", "csrf_token": token})
    assert page.status_code == 429 and "too many runs" in page.text
    assert int(page.headers["retry-after"]) >= 1
    other = {**basic("other", "other-password-1"), **JSON}
    assert limited.post(path, json={"run_id": "theirs"}, headers=other).status_code == 201
    with sessions() as session:
        runs = sorted(session.scalars(select(DagRun.run_id).where(DagRun.dag_id == WEB_DAG)))
    assert runs == ["r0", "r1", "r2", "theirs"]


def test_a_callback_token_is_throttled_on_its_own(
    settings: Settings, cipher: Cipher, sessions: sessionmaker[Session]
) -> None:
    token = make_token(cipher, 12345, 1, dt.datetime.now(dt.UTC))
    limits = {**LIMITS, "DEFERRAL_WEBSERVER_SIGNAL_RATE": "3/hour"}
    with web_client(settings, "0.0.0.0", limits) as client:
        path = f"/api/v1/callbacks/{token}"
        statuses = [client.post(path, json={"status": "success"}).status_code for _ in range(5)]
        # No such task (409) until the token's rate is spent; a forged token is refused (404)
        # before it could count against anything.
        assert statuses == [409, 409, 409, 429, 429]
        assert client.post(f"{path[:-4]}AAAA", json={}).status_code == 404
    assert _stored(sessions) == 0


def test_oversized_payloads_and_confs_are_refused_in_one_line(
    limited: TestClient, sessions: sessionmaker[Session]
) -> None:
    auth = {**basic("admin", ADMIN_PASSWORD), **JSON}
    signal = limited.post("/api/v1/signals/k", json={"payload": "x" * 70_000}, headers=auth)
    assert signal.status_code == 400
    assert signal.json()["error"] == "signal payload is 70002 bytes of JSON, more than 65536"
    conf = limited.post(
        f"/api/v1/dags/{WEB_DAG}/runs", json={"conf": {"a": "x" * 70_000}}, headers=auth
    )
    assert conf.status_code == 400
    assert conf.json()["error"] == "conf: must be at most 65536 bytes of JSON, not 70009"
    body = limited.post("/api/v1/signals/k", content=b"{" + b" " * 2_000_000 + b"}", headers=auth)
    assert body.status_code == 413 and "\n" not in body.text.strip()
    result = CliRunner().invoke(
        deferral_main, ["dags", "trigger", WEB_DAG, "--conf", '{"a": "' + "x" * 70_000 + '"}']
    )
    assert result.exit_code == 2
    assert "Invalid value for --conf: must be at most 65536 bytes of JSON" in result.output
    assert _stored(sessions) == 0


def test_one_senders_concurrent_sends_past_its_quota_never_deadlock(
    settings: Settings, sessions: sessionmaker[Session], cipher: Cipher
) -> None:
    kept, threads = 5, 8
    engine = make_engine(settings.database_url, pool_size=threads, max_overflow=0)
    many = make_sessionmaker(engine)
    sender = signals.Sender("bot", kept)

    def send_some() -> int:
        for n in range(25):
            with many.begin() as session:
                signals.send_in(session, cipher, f"k{n}", n, sender)
        return n

    try:
        sent = _at_once(threads, send_some)
    finally:
        engine.dispose()
    assert sent == [24] * threads  # no send failed (a deadlock raised before)
    with sessions() as session:
        stored = session.scalar(select(func.count()).where(Signal.sent_by == "bot"))
    # Rows another send was deleting are left to it: the quota holds once the sends end.
    assert stored is not None and stored <= kept + threads
    assert _counted(sessions, "bot") == stored  # the count the quota reads is the rows'


def _counted(sessions: sessionmaker[Session], sender: str) -> int:
    with sessions() as session:
        return session.scalar(
            select(func.coalesce(func.sum(SignalCount.stored), 0)).where(
                SignalCount.sent_by == sender
            )
        )


def test_a_senders_count_follows_its_signals_through_the_quota_and_the_retention(
    settings: Settings, sessions: sessionmaker[Session], cipher: Cipher
) -> None:
    sender = signals.Sender("aging", 3)
    for n in range(5):
        with sessions.begin() as session:
            signals.send_in(session, cipher, f"k{n}", n, sender)
    assert (_stored(sessions, "aging"), _counted(sessions, "aging")) == (3, 3)
    with sessions.begin() as session:  # two of them past the retention
        oldest = session.scalars(
            select(Signal.id).where(Signal.sent_by == "aging").order_by(Signal.id).limit(2)
        ).all()
        session.execute(
            update(Signal)
            .where(Signal.id.in_(oldest))
            .values(sent_at=func.now() - SIGNAL_RETENTION - dt.timedelta(hours=1))
        )
    with sessions.begin() as session:  # pruned by the next send, whoever sends it
        signals.send_in(session, cipher, "other", 0)
    assert (_stored(sessions, "aging"), _counted(sessions, "aging")) == (1, 1)
    for n in range(4):  # up to the quota again, and past it
        with sessions.begin() as session:
            signals.send_in(session, cipher, f"again{n}", n, sender)
    with sessions() as session:
        keys = session.scalars(
            select(Signal.key).where(Signal.sent_by == "aging").order_by(Signal.id)
        ).all()
    assert keys == ["again1", "again2", "again3"]
    assert _counted(sessions, "aging") == 3
