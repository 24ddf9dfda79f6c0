"""The web UI against someone guessing passwords, holding a copied cookie, rebinding DNS or
sending malformed parameters (Starlette's TestClient on the real database; the throttle's clock
is moved by hand instead of waiting)."""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Any

import pytest
from sqlalchemy import select, update
from sqlalchemy.orm import Session, sessionmaker
from starlette.testclient import TestClient

from broker.client import Broker
from deferral.runtime.config import Settings
from deferral.store.tables import WebSession
from tests.integration.conftest import web_client
from tests.integration.test_cli_users import run
from tests.integration.test_webserver import (
    ADMIN_PASSWORD,
    ENVIRON,
    WEB_DAG,
    basic,
    csrf_of,
    log_in,
    runs_of,
)
from webserver import auth as auth_module
from webserver import users
from webserver.app import create_app
from webserver.throttle import MAX_BACKOFF_SEC

pytestmark = pytest.mark.usefixtures("web_dag")


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _clock(client: TestClient) -> Clock:
    clock = Clock()
    client.app.state.ui.auth.clock = clock  # type: ignore[attr-defined]
    return clock


# -- guessing passwords --------------------------------------------------------------------------


def test_200_wrong_passwords_are_throttled_and_the_right_one_waits_for_the_backoff(
    exposed: TestClient, caplog: pytest.LogCaptureFixture
) -> None:
    clock = _clock(exposed)
    statuses = [log_in(exposed, "admin", f"guess-{n}").status_code for n in range(200)]
    assert statuses[:5] == [401] * 5
    assert set(statuses[6:]) == {429}
    right = log_in(exposed, "admin", ADMIN_PASSWORD)
    assert right.status_code == 429
    assert "Too many failed logins" in right.text
    assert int(right.headers["retry-after"]) >= 1
    assert exposed.get("/dags").status_code == 303  # not logged in
    # Backoff, not lockout: once it ends, the right password works.
    clock.now += MAX_BACKOFF_SEC + 1
    assert log_in(exposed, "admin", ADMIN_PASSWORD).status_code == 303
    assert exposed.get("/dags").status_code == 200
    refusals = [r for r in caplog.records if "refused a login as 'admin'" in r.getMessage()]
    assert len(refusals) == 201


def test_wrong_basic_credentials_are_throttled_and_logged(
    exposed: TestClient, caplog: pytest.LogCaptureFixture
) -> None:
    clock = _clock(exposed)
    statuses = [
        exposed.get("/api/v1/dags", headers=basic("admin", f"guess-{n}")).status_code
        for n in range(50)
    ]
    assert statuses[:5] == [401] * 5 and set(statuses[6:]) == {429}
    right = exposed.get("/api/v1/dags", headers=basic("admin", ADMIN_PASSWORD))
    assert right.status_code == 429 and "too many failed logins" in right.json()["error"]
    clock.now += MAX_BACKOFF_SEC + 1
    assert exposed.get("/api/v1/dags", headers=basic("admin", ADMIN_PASSWORD)).status_code == 200
    assert any("basic auth: refused a login as 'admin'" in r.getMessage() for r in caplog.records)


def test_a_refused_user_name_is_logged_cut_and_escaped(
    exposed: TestClient, caplog: pytest.LogCaptureFixture
) -> None:
    name = "forged\nINFO admin logged in\x1b[2J" + "x" * 900_000
    assert log_in(exposed, name, "wrong-password").status_code == 401
    exposed.get("/api/v1/dags", headers=basic(name, "wrong-password"))
    refused = [r.getMessage() for r in caplog.records if "refused a login" in r.getMessage()]
    assert len(refused) == 2
    for message in refused:
        assert len(message) < 300
        assert "\n" not in message and "\x1b" not in message
        assert "forged\\x0aINFO admin logged in\\x1b[2J" in message


@pytest.mark.usefixtures("product_password_hashes")  # verifications long enough to overlap
def test_argon2_verifications_are_bounded_and_off_the_event_loop(
    settings: Settings, sessions: sessionmaker[Session], broker: Broker
) -> None:
    app = create_app(settings, host="0.0.0.0", environ=ENVIRON)
    auth = app.state.ui.auth
    running, most = 0, 0
    lock = threading.Lock()
    real = auth._authenticate

    def counted(username: str, password: str) -> Any:
        nonlocal running, most
        assert threading.current_thread() is not threading.main_thread()
        with lock:
            running += 1
            most = max(most, running)
        try:
            return real(username, password)
        finally:
            with lock:
                running -= 1

    auth._authenticate = counted

    async def guesses() -> list[Any]:
        # Distinct clients and names: no throttling, every one is verified.
        return await asyncio.gather(
            *(auth.verify(f"10.0.0.{n}", f"user{n}", "wrong", "test") for n in range(12))
        )

    verdicts = asyncio.run(guesses())
    assert all(v.identity is None and v.retry_after_sec == 0 for v in verdicts)
    assert 1 <= most <= auth_module.ARGON2_CONCURRENCY


def test_a_right_basic_password_is_remembered_until_the_password_changes(
    exposed: TestClient, sessions: sessionmaker[Session]
) -> None:
    with sessions.begin() as session:
        users.create_user(session, "api", "api-password-1")
    auth = exposed.app.state.ui.auth  # type: ignore[attr-defined]
    calls = []
    real = auth._authenticate
    auth._authenticate = lambda u, p: calls.append(u) or real(u, p)
    for _ in range(3):
        assert (
            exposed.get("/api/v1/dags", headers=basic("api", "api-password-1")).status_code == 200
        )
    assert calls == ["api"]
    with sessions.begin() as session:
        users.delete_user(session, "api")
        users.create_user(session, "api", "api-password-2")
    assert exposed.get("/api/v1/dags", headers=basic("api", "api-password-1")).status_code == 401
    assert exposed.get("/api/v1/dags", headers=basic("api", "api-password-2")).status_code == 200


def test_a_short_admin_password_stops_the_webserver_in_one_line(
    settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(users.ADMIN_PASSWORD_ENV, "admin")
    refused = run("webserver", "--port", "1")
    assert refused.exit_code == 2
    assert refused.stderr == (
        f"error: {users.ADMIN_PASSWORD_ENV} is too short: the password must have at least"
        f" {users.MIN_PASSWORD_LENGTH} characters\n"
    )


def test_a_malformed_webserver_setting_stops_it_in_one_line(
    settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DEFERRAL_WEBSERVER_SESSION_LIFETIME", "forever")
    refused = run("webserver", "--port", "1")
    assert refused.exit_code == 2
    assert refused.stderr.startswith("error: DEFERRAL_WEBSERVER_SESSION_LIFETIME is malformed")
    assert len(refused.stderr.splitlines()) == 1


# -- sessions ------------------------------------------------------------------------------------


def test_a_cookie_copied_before_logout_is_refused_after(
    settings: Settings, exposed: TestClient
) -> None:
    assert log_in(exposed).status_code == 303
    copied = dict(exposed.cookies)
    token = csrf_of(exposed, "/dags")
    assert exposed.post("/logout", data={"csrf_token": token}).status_code == 303
    with web_client(settings, "0.0.0.0") as thief:
        thief.cookies.update(copied)
        assert thief.get("/dags").status_code == 303
        assert thief.get("/api/v1/dags").status_code == 401


def test_a_session_ends_at_its_lifetime_and_deleting_a_user_ends_every_copy(
    settings: Settings, exposed: TestClient, sessions: sessionmaker[Session]
) -> None:
    log_in(exposed)
    with sessions.begin() as session:
        row = session.scalars(select(WebSession)).one()
        lasts = row.expires_at - row.created_at
        assert lasts.total_seconds() == 12 * 3600
        session.execute(update(WebSession).values(expires_at=row.created_at))
    assert exposed.get("/dags").status_code == 303

    with sessions.begin() as session:
        users.create_user(session, "cy", "cy-password-1")
    log_in(exposed, "cy", "cy-password-1")
    copied = dict(exposed.cookies)
    with sessions.begin() as session:
        users.delete_user(session, "cy")
        assert session.scalars(select(WebSession).where(WebSession.username == "cy")).all() == []
    with web_client(settings, "0.0.0.0") as thief:
        thief.cookies.update(copied)
        assert thief.get("/dags").status_code == 303


def test_session_lifetime_and_secure_cookie_settings(
    settings: Settings, sessions: sessionmaker[Session], broker: Broker
) -> None:
    extra = {
        "DEFERRAL_WEBSERVER_SESSION_LIFETIME": "30m",
        "DEFERRAL_WEBSERVER_SECURE_COOKIES": "true",
    }
    with web_client(settings, "0.0.0.0", extra, scheme="https") as client:
        answer = log_in(client)
        cookie = answer.headers["set-cookie"].lower()
        assert "secure" in cookie and "max-age=1800" in cookie
    with sessions() as session:
        row = session.scalars(select(WebSession)).one()
        assert (row.expires_at - row.created_at).total_seconds() == 1800


# -- the Host header -----------------------------------------------------------------------------


def test_a_loopback_bind_answers_only_loopback_host_names(local: TestClient) -> None:
    for host in ("localhost", "localhost:8080", "127.0.0.1", "127.0.0.1:8080", "[::1]", "[::1]:80"):
        assert local.get("/dags", headers={"host": host}).status_code == 200, host
    for host in ("evil.example", "evil.example:8080", "localhost.evil.example", "", "[::2]"):
        refused = local.get("/dags", headers={"host": host})
        assert refused.status_code == 400, host
        assert "bad Host header" in refused.text
    assert local.get("/api/v1/health", headers={"host": "evil.example"}).status_code == 400


def test_other_binds_answer_the_allowed_hosts(
    settings: Settings, sessions: sessionmaker[Session], broker: Broker
) -> None:
    with web_client(settings, "0.0.0.0") as anyone:
        assert anyone.get("/login", headers={"host": "ui.example"}).status_code == 200
    extra = {"DEFERRAL_WEBSERVER_ALLOWED_HOSTS": "ui.example, ui.example:8443"}
    with web_client(settings, "0.0.0.0", extra) as listed:
        for host in ("ui.example", "UI.example:8443", "localhost:8080", "0.0.0.0"):
            assert listed.get("/login", headers={"host": host}).status_code == 200, host
        assert listed.get("/login", headers={"host": "evil.example"}).status_code == 400
    # Behind a proxy on this machine: its names pass, and pages need a login although the
    # server listens on loopback (the proxy lets other machines in).
    with web_client(
        settings, "127.0.0.1", {"DEFERRAL_WEBSERVER_ALLOWED_HOSTS": "ui.ex"}
    ) as proxied:
        assert proxied.get("/dags", headers={"host": "ui.ex"}).status_code == 303
        assert proxied.get("/dags", headers={"host": "evil.example"}).status_code == 400


# -- malformed parameters ------------------------------------------------------------------------

LONG_RUN_ID = "r" * 251
TI = f"/dags/{WEB_DAG}/task_instance"
LOG = f"/api/v1/dags/{WEB_DAG}/task_instance/log"
MALFORMED_GETS = [
    (f"{TI}?run_id=a%00b&task_id=a", "run_id must not contain control characters"),
    (f"{TI}?run_id=r&task_id=a%00", "task_id must not contain control characters"),
    (f"{TI}?run_id=a%0Ab&task_id=a", "run_id must not contain control characters"),
    ("/dags/web%00dag", "dag_id must not contain control characters"),
    (f"/dags/{WEB_DAG}?run_id=x%00", "run_id must not contain control characters"),
    (f"{TI}?run_id={LONG_RUN_ID}&task_id=a", "run_id is too long (251 characters, at most 250)"),
    (f"{TI}?run_id=r&task_id=a&try_number={10**30}", "try_number must be between 1 and"),
    (f"{TI}?run_id=r&task_id=a&map_index={'9' * 5000}", "map_index must be between -1 and"),
    (f"{LOG}?run_id=r&task_id=a&try_number=1&after_id={2**64}", "after_id must be between 0 and"),
    (f"{LOG}?run_id=r&task_id=a&try_number={2**40}", "try_number must be between 1 and"),
    (f"/dags/{WEB_DAG}?runs={10**20}", "runs must be between 1 and"),
]


def _no_traceback(caplog: pytest.LogCaptureFixture) -> None:
    assert [
        r.getMessage() for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR
    ] == []


@pytest.mark.parametrize(("path", "message"), MALFORMED_GETS)
def test_malformed_parameters_are_400_in_one_line_without_traceback(
    local: TestClient, caplog: pytest.LogCaptureFixture, path: str, message: str
) -> None:
    urls = [path] if path.startswith("/api/") else [path, path.replace("/dags/", "/api/v1/dags/")]
    for url in urls:
        answer = local.get(url)
        assert answer.status_code == 400, (url, answer.text[:500])
        said = answer.json()["error"] if "/api/" in url else answer.text
        assert message in said, said[:500]
    _no_traceback(caplog)


def test_malformed_api_bodies_are_400_without_traceback(
    local: TestClient, caplog: pytest.LogCaptureFixture, sessions: sessionmaker[Session]
) -> None:
    auth = {**basic("admin", ADMIN_PASSWORD), "content-type": "application/json"}
    deep = "[" * 100_000 + "]" * 100_000
    cases = [
        (f"/api/v1/dags/{WEB_DAG}/runs", '{"conf": ' + deep + "}", "nests deeper than 32"),
        (f"/api/v1/dags/{WEB_DAG}/runs", deep, "nests deeper than 32"),
        (f"/api/v1/dags/{WEB_DAG}/runs", '{"run_id": "' + LONG_RUN_ID + '"}', "too long"),
        (f"/api/v1/dags/{WEB_DAG}/runs", '{"run_id": "a\\u0000b"}', "control characters"),
        (f"/api/v1/dags/{WEB_DAG}/runs", '{"run_id": "a\\nb"}', "control characters"),
        (f"/api/v1/dags/{WEB_DAG}/clear", '{"run_id": "r\\u0000", "task_id": "a"}', "control"),
        (
            f"/api/v1/dags/{WEB_DAG}/mark",
            '{"run_id": "r", "task_id": "a\\u0000", "state": "failed"}',
            "control",
        ),
        ("/api/v1/dags/web%00dag/pause", "{}", "dag_id must not contain control characters"),
        (
            f"/api/v1/dags/{WEB_DAG}/clear",
            '{"run_id": "r", "task_id": "a", "map_indexes": [' + str(10**30) + "]}",
            "map_indexes must be at most 1024 integers from 0 to 1023",
        ),
        (
            f"/api/v1/dags/{WEB_DAG}/clear",
            '{"run_id": "r", "task_id": "a", "map_indexes": [' + "1," * 70_000 + "1]}",
            "map_indexes must be at most 1024 integers",
        ),
        (f"/api/v1/dags/{WEB_DAG}/runs", b'{"conf": "\xff"}', "not UTF-8"),
    ]
    for url, body, message in cases:
        answer = local.post(url, content=body, headers=auth)
        assert answer.status_code == 400, (url, answer.text[:300])
        assert message in answer.json()["error"], answer.text[:300]
    assert runs_of(sessions, WEB_DAG) == []
    _no_traceback(caplog)


def test_malformed_trigger_forms_are_refused_in_one_line_without_traceback(
    local: TestClient, caplog: pytest.LogCaptureFixture, sessions: sessionmaker[Session]
) -> None:
    log_in(local)
    token = csrf_of(local, f"/dags/{WEB_DAG}")
    deep_conf = '{"a": ' + "[" * 100_000 + "]" * 100_000 + "}"
    for form, message in [
        ({"conf": deep_conf}, "conf nests deeper than 32 levels"),
        ({"conf": "{}", "run_id": LONG_RUN_ID}, "run_id is too long"),
        ({"conf": "{}", "run_id": "evil\nINFO forged"}, "run_id must not contain control"),
    ]:
        answer = local.post(
            f"/dags/{WEB_DAG}/trigger", data={**form, "csrf_token": token}, follow_redirects=True
        )
        assert message in answer.text
    assert runs_of(sessions, WEB_DAG) == []
    _no_traceback(caplog)
