"""Text PostgreSQL cannot store, or that is no Unicode at all (NUL, lone surrogates, bytes that
are not UTF-8), sent to the web app and the ``deferral`` command: refused with one line naming
where it is (400, or the command's one error line), nothing written, no traceback."""

from __future__ import annotations

import html
import logging

import pytest
from click.testing import CliRunner
from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker
from starlette.testclient import TestClient

from deferral.runtime.config import Settings
from deferral.store.tables import DagRun, HITLDetail, Signal
from deferral_cli import main as deferral_main
from tests.integration.factories import awaiting_input_task
from tests.integration.test_webserver import ADMIN_PASSWORD, WEB_DAG, basic, csrf_of, log_in

pytestmark = pytest.mark.usefixtures("web_dag")

SURROGATE = "holds a lone surrogate (\\ud800), which is not Unicode text"
NUL = "must not contain control characters (\\x00)"


def _no_traceback(caplog: pytest.LogCaptureFixture) -> None:
    assert [
        r.getMessage() for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR
    ] == []


def _nothing_written(sessions: sessionmaker[Session]) -> None:
    with sessions() as session:
        assert session.scalar(select(func.count()).select_from(Signal)) == 0
        runs = select(func.count()).where(DagRun.dag_id == WEB_DAG)
        assert session.scalar(runs) == 0
        responded = select(func.count()).where(HITLDetail.responded_at.is_not(None))
        assert session.scalar(responded) == 0


def test_json_bodies_with_nul_or_lone_surrogates_are_400_on_each_endpoint(
    local: TestClient, sessions: sessionmaker[Session], caplog: pytest.LogCaptureFixture
) -> None:
    ti_id = awaiting_input_task(sessions, "asks", "r1")
    auth = {**basic("admin", ADMIN_PASSWORD), "content-type": "application/json"}
    cases: list[tuple[str, str, str]] = [
        ("/api/v1/signals/k", '{"payload": "\\ud800"}', f"the body: payload {SURROGATE}"),
        ("/api/v1/signals/k", '{"payload": {"a": ["\\u0000"]}}', f"the body: payload.a[0] {NUL}"),
        ("/api/v1/signals/k", '{"payload": {"\\udc80": 1}}', "the body: a key of payload holds"),
        (f"/api/v1/dags/{WEB_DAG}/runs", '{"conf": {"a": "\\ud800"}}', f"conf.a {SURROGATE}"),
        (f"/api/v1/dags/{WEB_DAG}/runs", '{"conf": {"a": "x\\u0000"}}', f"conf.a {NUL}"),
        (f"/api/v1/dags/{WEB_DAG}/runs", '{"run_id": "\\ud800"}', f"run_id {SURROGATE}"),
        (
            f"/api/v1/hitlDetails/{ti_id}",
            '{"chosen_options": ["\\ud800"]}',
            f"the body: chosen_options[0] {SURROGATE}",
        ),
        (
            f"/api/v1/hitlDetails/{ti_id}",
            '{"chosen_options": ["yes"], "params_input": {"n": "\\u0000"}}',
            f"the body: params_input.n {NUL}",
        ),
        ("/api/v1/callbacks/some-token", '{"status": "\\ud800"}', f"status {SURROGATE}"),
    ]
    for url, body, said in cases:
        answer = local.post(url, content=body, headers=auth)
        assert answer.status_code == 400, (url, body, answer.text[:300])
        assert said in answer.json()["error"], (url, answer.text[:300])
        assert "\n" not in answer.json()["error"]
    _nothing_written(sessions)
    _no_traceback(caplog)


@pytest.mark.parametrize(
    ("path", "said"),
    [
        ("/dags?tags=%ed%a0%80", "the query string's tags is not UTF-8"),
        ("/dags?tags=%ff", "the query string's tags is not UTF-8"),
        ("/api/v1/dags?tags=a%00", f"the query string's tags {NUL}"),
        (f"/api/v1/dags/{WEB_DAG}?x%00=1", "the query string's x\\x00 must not contain"),
        ("/required_actions?dag_id=%ed%a0%80", "the query string's dag_id is not UTF-8"),
    ],
)
def test_query_strings_that_are_not_utf8_or_hold_nul_are_400(
    local: TestClient, caplog: pytest.LogCaptureFixture, path: str, said: str
) -> None:
    answer = local.get(path)
    assert answer.status_code == 400, answer.text[:300]
    assert said in (answer.json()["error"] if "/api/" in path else html.unescape(answer.text))
    _no_traceback(caplog)


def test_form_fields_that_are_not_utf8_or_hold_nul_are_400(
    local: TestClient, sessions: sessionmaker[Session], caplog: pytest.LogCaptureFixture
) -> None:
    form = {"content-type": "application/x-www-form-urlencoded"}
    login = local.post("/login", content=b"username=ad%00min&password=x", headers=form)
    assert login.status_code == 400
    assert f"the form's username {NUL}" in html.unescape(login.text)
    login = local.post("/login", content=b"username=%ed%a0%80&password=x", headers=form)
    assert login.status_code == 400
    assert "the form's username is not UTF-8" in html.unescape(login.text)
    log_in(local)
    token = csrf_of(local, f"/dags/{WEB_DAG}")
    for body in (
        b"conf=%7B%7D&run_id=r%00",
        b"conf=%7B%22a%22%3A%20%22%ED%A0%80%22%7D",  # {"a": "<a lone surrogate's bytes>"}
    ):
        answer = local.post(
            f"/dags/{WEB_DAG}/trigger",
            content=body + b"&csrf_token=" + token.encode(),
            headers=form,
        )
        assert answer.status_code == 400, answer.text[:300]
    flashed = local.post(
        f"/dags/{WEB_DAG}/trigger",
        data={"conf": '{"a": "\\ud800"}', "csrf_token": token},
        follow_redirects=True,
    )
    assert f"conf: a {SURROGATE}" in html.unescape(flashed.text)
    _nothing_written(sessions)
    _no_traceback(caplog)


def _cli(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(deferral_main, list(args))
    return result.exit_code, result.stderr


@pytest.mark.parametrize(
    ("args", "code", "said"),
    [
        (
            ["signals", "send", "k", "--payload", '"\\ud800"'],
            1,
            f"error: signal payload {SURROGATE}",
        ),
        (
            ["signals", "send", "k", "--payload", '["\\u0000"]'],
            1,
            f"error: signal payload: [0] {NUL}",
        ),
        (["signals", "send", "k\udcff"], 2, "error: argument 3 ('k\\udcff') is not UTF-8 text"),
        (
            ["dags", "trigger", WEB_DAG, "--conf", '{"a": "\\ud800"}'],
            2,
            f"Error: Invalid value for --conf: a {SURROGATE}",
        ),
        (
            ["dags", "trigger", WEB_DAG, "--conf", '{"a": "\udcff"}'],
            2,
            'error: argument 5 (\'{"a": "\\udcff"}\') is not UTF-8 text',
        ),
        (
            ["approvals", "respond", "1", "\udcff"],
            2,
            "error: argument 4 ('\\udcff') is not UTF-8 text",
        ),
        (
            ["approvals", "respond", "1", "yes", "--params", '{"n": "\\ud800"}'],
            1,
            f"error: --params: n {SURROGATE}",
        ),
    ],
)
def test_the_command_refuses_them_in_one_line(
    settings: Settings, sessions: sessionmaker[Session], args: list[str], code: int, said: str
) -> None:
    exit_code, err = _cli(*args)
    assert exit_code == code, err
    assert [line for line in err.splitlines() if line.lower().startswith("error:")] == [said]
    _nothing_written(sessions)
