"""The web UI's application against the real database and Redis (Starlette's TestClient, no
browser): who may read and act, CSRF, the actions taking the CLI's paths, the JSON API, escaping,
secrets, and what bad input gets. tests/e2e/test_webui_browser.py drives it in Chromium."""

from __future__ import annotations

import base64
import dataclasses
import datetime as dt
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import generate_latest
from sqlalchemy import insert, select
from sqlalchemy.orm import Session, sessionmaker
from starlette.testclient import TestClient

from broker.client import Broker
from deferral.runtime import metrics
from deferral.runtime.config import Settings
from deferral.runtime.crypto import Cipher, Purpose
from deferral.states import DagRunState, TaskState
from deferral.store import tasklogs, transitions
from deferral.store.tables import (
    Dag,
    DagRun,
    StoredConnection,
    TaskInstance,
    TaskStateChange,
    Trigger,
)
from deferral_cli.embedded import free_port
from tests.integration.conftest import CLI_DAG_SOURCE, WEB_ADMIN_PASSWORD, WEB_DAG, web_client
from tests.integration.factories import DAG_ID, deferred_task, running_task
from tests.redis_topologies import free_ports
from webserver import users
from webserver.app import create_app

ADMIN_PASSWORD = WEB_ADMIN_PASSWORD
ENVIRON = {users.ADMIN_PASSWORD_ENV: ADMIN_PASSWORD}
CSRF = re.compile(r'name="csrf_token" value="([^"]+)"')


def csrf_of(client: TestClient, path: str = "/login") -> str:
    found = CSRF.search(client.get(path).text)
    assert found is not None
    return found.group(1)


def log_in(client: TestClient, username: str = "admin", password: str = ADMIN_PASSWORD) -> Any:
    token = csrf_of(client)
    return client.post(
        "/login",
        data={"username": username, "password": password, "csrf_token": token, "next": "/dags"},
    )


def basic(username: str, password: str) -> dict[str, str]:
    encoded = base64.b64encode(f"{username}:{password}".encode()).decode()
    return {"authorization": f"Basic {encoded}"}


def runs_of(sessions: sessionmaker[Session], dag_id: str) -> list[DagRun]:
    with sessions() as session:
        return list(session.scalars(select(DagRun).where(DagRun.dag_id == dag_id)))


# -- who may read and act ------------------------------------------------------------------------

PAGES = ["/dags", f"/dags/{WEB_DAG}", "/deferred", "/triggerers", "/streams", "/doctor"]
API_READS = ["/api/v1/dags", f"/api/v1/dags/{WEB_DAG}", "/api/v1/deferred", "/api/v1/triggerers"]


def test_on_loopback_every_page_and_api_read_is_open(local: TestClient, web_dag: str) -> None:
    for path in [*PAGES, *API_READS, "/api/v1/streams", "/api/v1/doctor"]:
        answer = local.get(path)
        assert answer.status_code == 200, (path, answer.text[:300])
    assert 'id="login-link"' in local.get("/dags").text


def test_on_other_addresses_every_page_needs_a_login(exposed: TestClient, web_dag: str) -> None:
    for path in PAGES:
        answer = exposed.get(path)
        assert answer.status_code == 303, path
        assert answer.headers["location"].startswith("/login?next=")
    for path in API_READS:
        assert exposed.get(path).status_code == 401, path
    assert exposed.get("/api/v1/health").json() == {"status": "ok"}
    assert exposed.get("/login").status_code == 200

    assert log_in(exposed).status_code == 303
    for path in PAGES:
        assert exposed.get(path).status_code == 200, path
    assert exposed.get("/api/v1/dags", headers=basic("admin", ADMIN_PASSWORD)).status_code == 200


def test_a_wrong_password_is_refused(exposed: TestClient, sessions: sessionmaker[Session]) -> None:
    with sessions.begin() as session:
        users.create_user(session, "ann", "ann-password-1")
    for name, password in [("admin", "wrong"), ("ann", "admin-pass"), ("nobody", ADMIN_PASSWORD)]:
        refused = log_in(exposed, name, password)
        assert refused.status_code == 401
        assert "Wrong user name or password." in refused.text
        assert exposed.get("/dags").status_code == 303  # still not logged in
    assert exposed.get("/api/v1/dags", headers=basic("ann", "nope")).status_code == 401
    assert log_in(exposed, "ann", "ann-password-1").status_code == 303
    assert exposed.get("/dags").status_code == 200


def test_a_deleted_user_or_changed_admin_password_ends_the_session(
    settings: Settings, sessions: sessionmaker[Session], broker: Broker
) -> None:
    with sessions.begin() as session:
        users.create_user(session, "bob", "bob-password-1")
    with web_client(settings, "0.0.0.0") as client:
        log_in(client, "bob", "bob-password-1")
        assert client.get("/dags").status_code == 200
        with sessions.begin() as session:
            users.delete_user(session, "bob")
        assert client.get("/dags").status_code == 303
        log_in(client)
        cookies = dict(client.cookies)
    changed = {users.ADMIN_PASSWORD_ENV: "a-new-admin-password"}
    with TestClient(
        create_app(settings, host="0.0.0.0", environ=changed), base_url="http://localhost"
    ) as other:
        other.cookies.update(cookies)
        assert other.get("/dags", follow_redirects=False).status_code == 303


# -- actions: CSRF, login, and the CLI's paths ----------------------------------------------------


def test_an_action_without_its_csrf_token_changes_nothing(
    local: TestClient, web_dag: str, sessions: sessionmaker[Session]
) -> None:
    log_in(local)
    for token in (None, "forged"):
        form = {"conf": "{}"} if token is None else {"conf": "{}", "csrf_token": token}
        refused = local.post(f"/dags/{WEB_DAG}/trigger", data=form)
        assert refused.status_code == 403
        assert "CSRF token missing or wrong" in refused.text
    assert runs_of(sessions, WEB_DAG) == []


def test_acting_needs_a_login_even_on_loopback(
    local: TestClient, web_dag: str, sessions: sessionmaker[Session]
) -> None:
    token = csrf_of(local, f"/dags/{WEB_DAG}")
    answer = local.post(f"/dags/{WEB_DAG}/trigger", data={"conf": "{}", "csrf_token": token})
    assert answer.status_code == 303 and answer.headers["location"].startswith("/login")
    assert runs_of(sessions, WEB_DAG) == []


def test_trigger_with_conf_pause_and_unpause(
    local: TestClient, web_dag: str, sessions: sessionmaker[Session]
) -> None:
    log_in(local)
    token = csrf_of(local, f"/dags/{WEB_DAG}")
    answer = local.post(
        f"/dags/{WEB_DAG}/trigger",
        data={"conf": '{"who": "web"}', "run_id": "from-the-ui", "csrf_token": token},
    )
    assert answer.status_code == 303
    (run,) = runs_of(sessions, WEB_DAG)
    assert (run.run_id, run.conf, run.run_type) == ("from-the-ui", {"who": "web"}, "manual")
    page = local.get(answer.headers["location"]).text
    assert f"triggered {WEB_DAG} from-the-ui" in page

    duplicate = local.post(
        f"/dags/{WEB_DAG}/trigger", data={"conf": "", "run_id": "from-the-ui", "csrf_token": token}
    )
    said = local.get(duplicate.headers["location"]).text
    assert f"DAG &#39;{WEB_DAG}&#39; already has a run &#39;from-the-ui&#39;" in said

    for action, paused in (("pause", True), ("unpause", False)):
        done = local.post(f"/dags/{WEB_DAG}/{action}", data={"csrf_token": token, "next": "/dags"})
        assert done.status_code == 303 and done.headers["location"] == "/dags"
        with sessions() as session:
            row = session.get(Dag, WEB_DAG)
            assert row is not None and row.is_paused is paused


def test_bad_conf_is_said_in_one_line_and_creates_nothing(
    local: TestClient, web_dag: str, sessions: sessionmaker[Session]
) -> None:
    log_in(local)
    token = csrf_of(local, f"/dags/{WEB_DAG}")
    for conf, message in [
        ("{nope", "conf: not valid JSON (Expecting property name enclosed in double quotes at 1)"),
        ("[1]", "conf: must be a JSON object"),
    ]:
        answer = local.post(f"/dags/{WEB_DAG}/trigger", data={"conf": conf, "csrf_token": token})
        assert answer.status_code == 303
        assert (
            f'<div class="flash error">{message}</div>'
            in local.get(answer.headers["location"]).text
        )
    assert runs_of(sessions, WEB_DAG) == []


def _finished_run(sessions: sessionmaker[Session], run_id: str) -> None:
    """A run of web_dag whose tasks a and b both succeeded, through the real transitions."""
    with sessions.begin() as session:
        transitions.create_dag_run(session, WEB_DAG, run_id, dt.datetime.now(dt.UTC), {})
        run = session.scalars(select(DagRun).where(DagRun.run_id == run_id)).one()
        transitions.start_dag_run(
            session,
            run,
            [transitions.NewTaskInstance(t, 0, "default_pool", 1, "default", 1) for t in "ab"],
        )
        session.flush()
        ids = list(session.scalars(select(TaskInstance.id).where(TaskInstance.run_id == run_id)))
        transitions.schedule(session, ids)
        transitions.dispatch(session, ids)
        transitions.start_many(session, [(i, 1) for i in ids], "host", "w")
        for i in ids:
            assert transitions.succeed(session, transitions.Attempt(i, 1, "w"), None)
        transitions.finish_dag_run(session, run, DagRunState.SUCCESS)


def _states(sessions: sessionmaker[Session], run_id: str) -> dict[str, tuple[str, int]]:
    with sessions() as session:
        rows = session.execute(
            select(TaskInstance.task_id, TaskInstance.state, TaskInstance.try_number).where(
                TaskInstance.run_id == run_id
            )
        )
        return {task_id: (state, tries) for task_id, state, tries in rows}


def test_clear_and_mark_take_the_clis_path(
    local: TestClient, web_dag: str, sessions: sessionmaker[Session]
) -> None:
    _finished_run(sessions, "done")
    log_in(local)
    token = csrf_of(local, f"/dags/{WEB_DAG}")
    cleared = local.post(
        f"/dags/{WEB_DAG}/change",
        data={
            "action": "clear",
            "run_id": "done",
            "task_id": "a",
            "downstream": "on",
            "csrf_token": token,
        },
    )
    assert cleared.status_code == 303
    assert "task_id=a" in cleared.headers["location"]
    assert _states(sessions, "done") == {"a": ("none", 1), "b": ("none", 1)}
    assert runs_of(sessions, WEB_DAG)[0].state == "running"  # reopened, as `tasks clear` does
    assert "a: none, b: none" in local.get(cleared.headers["location"]).text

    local.post(
        f"/dags/{WEB_DAG}/change",
        data={
            "action": "mark",
            "state": "skipped",
            "run_id": "done",
            "task_id": "b",
            "csrf_token": token,
        },
    )
    assert _states(sessions, "done")["b"][0] == "skipped"
    bad = local.post(
        f"/dags/{WEB_DAG}/change",
        data={
            "action": "mark",
            "state": "running",
            "run_id": "done",
            "task_id": "b",
            "csrf_token": token,
        },
    )
    assert bad.status_code == 400
    assert "a task can be marked success, failed, skipped, not &#39;running&#39;" in bad.text
    with sessions() as session:
        reasons = set(session.scalars(select(TaskStateChange.reason)))
    assert {"cleared by user", "marked skipped by user"} <= reasons


# -- the JSON API ----------------------------------------------------------------------------


def test_setup_and_teardown_tasks_are_marked_in_the_grid(
    local: TestClient, write_dag: Callable[[str, str], Path]
) -> None:
    write_dag(
        "web_setup_teardown",
        """
from deferral import DAG
from deferral.operators import EmptyOperator

with DAG("web_setup_teardown"):
    create = EmptyOperator(task_id="create").as_setup()
    create >> EmptyOperator(task_id="work") >> EmptyOperator(task_id="delete").as_teardown(
        setups=create
    )
""",
    )
    grid = local.get("/api/v1/dags/web_setup_teardown").json()
    roles = {t["task_id"]: t["role"] for t in grid["tasks"]}
    assert roles == {"create": "setup", "work": None, "delete": "teardown"}
    assert grid["roles"] == {"create": "setup", "delete": "teardown"}
    page = local.get("/dags/web_setup_teardown").text
    assert "<title>create (setup task): no task instance</title>" in page
    assert "<title>delete (teardown task): no task instance</title>" in page


def test_api_reads_give_the_pages_data(
    local: TestClient, web_dag: str, sessions: sessionmaker[Session], cipher: Cipher
) -> None:
    _finished_run(sessions, "done")
    deferred_task(sessions, cipher, task_id="waits", run_id="r-deferred")
    dags = local.get("/api/v1/dags").json()
    listed = {d["dag_id"]: d for d in dags["dags"]}
    assert (listed[WEB_DAG]["schedule"], listed[WEB_DAG]["tasks"]) == ("None", 2)
    assert listed[WEB_DAG]["recent_runs"][0]["run_id"] == "done"

    grid = local.get(f"/api/v1/dags/{WEB_DAG}").json()
    assert [t["task_id"] for t in grid["tasks"]] == ["a", "b"]
    assert grid["tasks"][1]["upstream"] == ["a"]
    assert grid["tasks"][0]["cells"][0]["state"] == "success"
    assert grid["graph"]["states"] == {"a": "success", "b": "success"}
    assert len(grid["graph"]["edges"]) == 1

    ti = local.get(
        f"/api/v1/dags/{DAG_ID}/task_instance", params={"run_id": "r-deferred", "task_id": "waits"}
    ).json()
    assert ti["task_instance"]["state"] == "deferred"
    assert ti["deferred"]["classpath"] == "deferral.triggers.temporal.DateTimeTrigger"
    assert [h["to_state"] for h in ti["history"]][-1] == "deferred"

    deferred = local.get("/api/v1/deferred").json()
    assert deferred["total"] == 1
    (group,) = deferred["groups"]
    assert group["tasks"][0]["label"] == "waits"


def test_api_writes_need_credentials_json_and_csrf_with_a_cookie(
    local: TestClient, web_dag: str, sessions: sessionmaker[Session]
) -> None:
    url = f"/api/v1/dags/{WEB_DAG}/runs"
    body = {"conf": {"n": 1}, "run_id": "api-1"}
    assert local.post(url, json=body).status_code == 401
    assert local.post(url, json=body, headers=basic("admin", "wrong")).status_code == 401
    form = local.post(url, data={"conf": "{}"}, headers=basic("admin", ADMIN_PASSWORD))
    assert form.status_code == 415
    created = local.post(url, json=body, headers=basic("admin", ADMIN_PASSWORD))
    assert created.status_code == 201, created.text
    assert created.json() == {"dag_id": WEB_DAG, "run_id": "api-1", "paused": False}
    assert runs_of(sessions, WEB_DAG)[0].conf == {"n": 1}

    log_in(local)  # a cookie alone is not enough: the CSRF token must come as a header
    assert local.post(url, json={"run_id": "api-2"}).status_code == 403
    token = csrf_of(local, "/dags")
    with_token = local.post(url, json={"run_id": "api-2"}, headers={"x-csrf-token": token})
    assert with_token.status_code == 201

    paused = local.post(
        f"/api/v1/dags/{WEB_DAG}/pause", json={}, headers=basic("admin", ADMIN_PASSWORD)
    )
    assert paused.json() == {"dag_id": WEB_DAG, "is_paused": True}


def test_api_clear_says_what_it_refused(
    local: TestClient, sessions: sessionmaker[Session], write_dag: Callable[[str, str], Path]
) -> None:
    write_dag(DAG_ID, CLI_DAG_SOURCE.format(dag_id=DAG_ID).replace('"a"', '"t"'))
    running_task(sessions, "t", "r1")
    answer = local.post(
        f"/api/v1/dags/{DAG_ID}/clear",
        json={"run_id": "r1", "task_id": "t"},
        headers=basic("admin", ADMIN_PASSWORD),
    )
    assert answer.status_code == 409
    assert answer.json() == {"changed": [], "refused": ["t (running)"]}


@pytest.mark.parametrize(
    ("path", "status", "message"),
    [
        ("/api/v1/dags/nope", 404, "DAG 'nope' not found"),
        (f"/api/v1/dags/{WEB_DAG}?runs=0", 400, "runs must be between 1 and 100, not 0"),
        (f"/api/v1/dags/{WEB_DAG}/task_instance?task_id=a", 400, "run_id is required"),
        (
            f"/api/v1/dags/{WEB_DAG}/task_instance?run_id=r&task_id=a&map_index=x",
            400,
            "map_index must be an integer, not 'x'",
        ),
        (f"/api/v1/dags/{WEB_DAG}/task_instance?run_id=r&task_id=a", 404, "has no run 'r'"),
        ("/api/v1/nothing", 404, "no such API path"),
    ],
)
def test_bad_input_gets_one_line_naming_it(
    local: TestClient, web_dag: str, path: str, status: int, message: str
) -> None:
    answer = local.get(path)
    assert answer.status_code == status
    assert message in answer.json()["error"]
    page = local.get(path.replace("/api/v1", ""))
    assert page.status_code == status
    assert message.replace("'", "&#39;").replace("API path", "page") in page.text


def test_api_write_bad_input(local: TestClient, web_dag: str) -> None:
    auth = basic("admin", ADMIN_PASSWORD)
    cases = [
        (f"/api/v1/dags/{WEB_DAG}/runs", {"conf": [1]}, 400, "conf must be a JSON object"),
        ("/api/v1/dags/nope/runs", {}, 404, "DAG 'nope' not found"),
        (f"/api/v1/dags/{WEB_DAG}/clear", {"task_id": "a"}, 400, "run_id is required"),
        (f"/api/v1/dags/{WEB_DAG}/clear", {"run_id": "r", "task_id": "zz"}, 404, "zz"),
        (
            f"/api/v1/dags/{WEB_DAG}/mark",
            {"run_id": "r", "task_id": "a", "state": "queued"},
            400,
            "not 'queued'",
        ),
        (
            f"/api/v1/dags/{WEB_DAG}/clear",
            {"run_id": "r", "task_id": "a", "map_indexes": "1"},
            400,
            "map_indexes must be a list of integers",
        ),
    ]
    for url, body, status, message in cases:
        answer = local.post(url, json=body, headers=auth)
        assert answer.status_code == status, (url, answer.text)
        assert message in answer.json()["error"], answer.text
    not_json = local.post(
        f"/api/v1/dags/{WEB_DAG}/runs",
        content=b"{nope",
        headers={**auth, "content-type": "application/json"},
    )
    assert not_json.status_code == 400 and not_json.json()["error"] == "the body is not valid JSON"


# -- escaping and secrets ------------------------------------------------------------------------

SCRIPT_RUN = "<script>window.__xss=1</script>"
SCRIPT_TASK = '<img src=x onerror="window.__xss=2">'


def add_hostile_rows(sessions: sessionmaker[Session], dag_id: str) -> None:
    """A run id and a task id holding markup (neither is checked in the tables)."""
    with sessions.begin() as session:
        transitions.create_dag_run(session, dag_id, SCRIPT_RUN, dt.datetime.now(dt.UTC), {})
        session.execute(
            insert(TaskInstance).values(
                dag_id=dag_id, run_id=SCRIPT_RUN, task_id=SCRIPT_TASK, state=TaskState.FAILED
            )
        )


def test_markup_in_ids_is_shown_as_text(
    local: TestClient, web_dag: str, sessions: sessionmaker[Session]
) -> None:
    add_hostile_rows(sessions, WEB_DAG)
    pages = [
        "/dags",
        f"/dags/{WEB_DAG}",
        f"/dags/{WEB_DAG}/task_instance?"
        + "&".join([f"run_id={SCRIPT_RUN}", "task_id=" + SCRIPT_TASK.replace('"', "%22")]),
    ]
    for path in pages:
        html = local.get(path).text
        assert "<script>window" not in html and "<img src=x" not in html, path
        assert "&lt;script&gt;window.__xss=1&lt;/script&gt;" in html, path
    assert (
        "&lt;img src=x onerror=&#34;window.__xss=2&#34;&gt;" in local.get(f"/dags/{WEB_DAG}").text
    )
    policy = local.get("/dags").headers["content-security-policy"]
    assert "script-src 'self'" in policy
    api = local.get(f"/api/v1/dags/{WEB_DAG}").json()
    assert SCRIPT_TASK in [t["task_id"] for t in api["tasks"]]


def test_no_secret_in_any_page_or_api_answer(
    local: TestClient,
    settings: Settings,
    sessions: sessionmaker[Session],
    cipher: Cipher,
    web_dag: str,
) -> None:
    trigger_secret, resume_secret, conn_secret = "kw-s3cret-9", "resume-s3cret-7", "conn-s3cret-5"
    ti_id, trigger_id = deferred_task(
        sessions, cipher, next_kwargs={"token": resume_secret}, task_id="waits", run_id="rs"
    )
    with sessions.begin() as session:
        trigger_row = session.get(Trigger, trigger_id)
        assert trigger_row is not None
        trigger_row.kwargs = cipher.seal(Purpose.TRIGGER_KWARGS, {"api_key": trigger_secret})
        session.add(
            StoredConnection(
                conn_id="db",
                conn_type="postgres",
                password=cipher.encrypt(Purpose.STORED_SECRET, conn_secret.encode()),
            )
        )
        transitions.create_dag_run(
            session, WEB_DAG, "with-conf", dt.datetime.now(dt.UTC), {"password": "conf-s3cret-3"}
        )
    log_in(local)
    query = {"run_id": "rs", "task_id": "waits"}
    answers = [
        local.get(path).text for path in [*PAGES, *API_READS, "/api/v1/streams", "/api/v1/doctor"]
    ]
    answers.append(local.get(f"/dags/{DAG_ID}/task_instance", params=query).text)
    answers.append(local.get(f"/api/v1/dags/{DAG_ID}/task_instance", params=query).text)
    answers.append(
        local.get(
            f"/api/v1/dags/{WEB_DAG}/task_instance", params={"run_id": "with-conf", "task_id": "a"}
        ).text
    )
    with sessions() as session:
        sealed = [session.get(TaskInstance, ti_id).next_kwargs, trigger_row.kwargs]  # type: ignore[union-attr]
    for text in answers:
        for secret in (
            trigger_secret,
            resume_secret,
            conn_secret,
            "conf-s3cret-3",
            ADMIN_PASSWORD,
            *settings.fernet_keys,
            *[s for s in sealed if s],
        ):
            assert secret not in text
    assert '"password": "***"' in answers[-1]


# -- logs ----------------------------------------------------------------------------------------


def test_a_tries_log_is_shown_escaped_and_tailed_through_the_api(
    local: TestClient, sessions: sessionmaker[Session], cipher: Cipher
) -> None:
    ti_id, _ = deferred_task(sessions, cipher, task_id="waits", run_id="rl")
    moment = dt.datetime.now(dt.UTC)
    texts = ["starting", "<script>window.__xss=3</script>", "deferring"]
    with sessions.begin() as session:
        tasklogs.append(
            session,
            [tasklogs.NewLine(ti_id, 1, moment, "task", text) for text in texts],
            max_bytes=1_000_000,
        )
    query = {"run_id": "rl", "task_id": "waits"}
    page = local.get(f"/dags/{DAG_ID}/task_instance", params=query).text
    assert "starting" in page and "&lt;script&gt;window.__xss=3&lt;/script&gt;" in page
    assert "<script>window" not in page
    assert "data-tail" in page  # deferred: the try goes on, the page tails its log

    url = f"/api/v1/dags/{DAG_ID}/task_instance/log"
    first = local.get(url, params={**query, "try_number": 1, "limit": 2}).json()
    assert [line["text"] for line in first["lines"]] == texts[:2]
    assert first["finished"] is False
    rest = local.get(
        url, params={**query, "try_number": 1, "after_id": first["lines"][-1]["id"]}
    ).json()
    assert [line["text"] for line in rest["lines"]] == texts[2:]
    assert local.get(url, params={**query, "try_number": "x"}).status_code == 400
    missing = local.get(f"/dags/{DAG_ID}/task_instance", params={**query, "try_number": 7})
    assert missing.status_code == 404 and "has no try 7" in missing.text


def test_an_unreachable_database_is_one_line_without_its_password(
    settings: Settings, web_dag: str
) -> None:
    port = free_port()
    gone = dataclasses.replace(
        settings, database_url=f"postgresql+psycopg://u:pw-s3cret@127.0.0.1:{port}/prod"
    )
    with TestClient(
        create_app(gone, host="127.0.0.1", environ=ENVIRON), base_url="http://localhost"
    ) as client:
        for path, api in (("/dags", False), ("/api/v1/deferred", True)):
            answer = client.get(path)
            assert answer.status_code == 503
            said = f"cannot reach PostgreSQL at 127.0.0.1:{port}/prod: connection refused"
            assert said in (answer.json()["error"] if api else answer.text)
            assert "pw-s3cret" not in answer.text


# -- request metrics -----------------------------------------------------------------------------


def _requests(method: str, route: str, status: str) -> float:
    labels = {"method": method, "route": route, "status": status}
    registry = metrics.registry_for(metrics.WEBSERVER)
    return registry.get_sample_value("deferral_webserver_requests_total", labels) or 0.0


def test_requests_are_counted_by_route_pattern_never_by_path(
    local: TestClient, web_dag: str
) -> None:
    before = _requests("GET", "/dags/{dag_id}", "200")
    assert local.get(f"/dags/{WEB_DAG}").status_code == 200
    assert _requests("GET", "/dags/{dag_id}", "200") == before + 1
    # Paths an attacker chooses all land on one series; so do methods nobody serves.
    unmatched = _requests("GET", "unmatched", "404")
    for n in range(3):
        local.get(f"/no-such-page-{n}")
    assert _requests("GET", "unmatched", "404") == unmatched + 3
    local.request("BREW", "/dags")
    shown = generate_latest(metrics.registry_for(metrics.WEBSERVER)).decode()
    assert "no-such-page" not in shown and "BREW" not in shown
    assert 'deferral_webserver_request_seconds_count{route="/dags/{dag_id}"}' in shown


LABELLED_DAG = """
from deferral import DAG
from deferral.operators import EmptyOperator
from deferral.utils.edgemodifier import Label

with DAG("web_labels", schedule=None):
    check = EmptyOperator(task_id="check")
    check >> Label("when empty") >> EmptyOperator(task_id="handle_empty")
    check >> EmptyOperator(task_id="load")
"""


def test_edge_labels_are_drawn_on_their_edges(
    local: TestClient, write_dag: Callable[[str, str], Path]
) -> None:
    write_dag("web_labels", LABELLED_DAG)
    page = local.get("/dags/web_labels")
    assert page.status_code == 200, page.text[:300]
    assert (
        '<text class="edge-label" x="' in page.text
        and 'data-source="check" data-target="handle_empty">when empty<title>' in page.text
    )
    edges = local.get("/api/v1/dags/web_labels").json()["graph"]["edges"]
    assert {(e["source"], e["target"], e["label"]) for e in edges} == {
        ("check", "handle_empty", "when empty"),
        ("check", "load", ""),
    }


def test_the_dag_list_shows_tags_and_filters_by_them(
    local: TestClient,
    sessions: sessionmaker[Session],
    write_dag: Callable[[str, str], Path],
) -> None:
    for name, tags in (("tagged_etl", ["etl", "daily"]), ("tagged_ml", ["ml"])):
        write_dag(name, f"from deferral import DAG\ndag = DAG('{name}', tags={tags!r})\n")
    # A DAG whose file fails to import now keeps the tags it was last parsed with.
    broken = write_dag("tagged_gone", "raise RuntimeError('broken')\n")
    with sessions.begin() as session:
        session.add(
            Dag(dag_id="tagged_gone", fileloc=str(broken), tags=["etl"], missing_reason="broken")
        )
    page = local.get("/dags", params={"tags": "etl"})
    assert page.status_code == 200
    assert "tagged_etl" in page.text and "tagged_gone" in page.text
    assert "tagged_ml" not in page.text
    assert '<a class="tag" href="/dags?tags=daily">daily</a>' in page.text
    listed = local.get("/api/v1/dags", params=[("tags", "ml"), ("tags", "daily")]).json()
    assert {dag["dag_id"]: dag["tags"] for dag in listed["dags"]} == {
        "tagged_etl": ["etl", "daily"],
        "tagged_ml": ["ml"],
    }
    assert local.get("/api/v1/dags", params={"tags": "ml,none"}).json()["tags"] == ["ml", "none"]
    everything = local.get("/api/v1/dags").json()["dags"]
    assert {"tagged_etl", "tagged_ml", "tagged_gone"} <= {dag["dag_id"] for dag in everything}


PARAMS_DAG = """
from deferral import DAG
from deferral.models.param import Param
from deferral.operators import EmptyOperator

with DAG(
    "web_params",
    schedule=None,
    params={
        "who": Param("world", type="string", description="whom to greet"),
        "times": Param(3, type="integer", minimum=1),
        "colour": Param("red", enum=["red", "green"]),
    },
):
    EmptyOperator(task_id="greet")
"""


def test_the_trigger_form_has_a_field_per_param_and_its_values_become_the_conf(
    local: TestClient, sessions: sessionmaker[Session], write_dag: Callable[[str, str], Path]
) -> None:
    write_dag("web_params", PARAMS_DAG)
    log_in(local)
    page = local.get("/dags/web_params").text
    assert 'name="param:who" type="text" value="world"' in page
    assert 'name="param:times" type="number" value="3"' in page
    assert '<option value="&#34;green&#34;">&#34;green&#34;</option>' in page
    assert "whom to greet" in page
    token = csrf_of(local, "/dags/web_params")

    def trigger(**fields: str) -> Any:
        data = {"conf": "{}", "csrf_token": token, **{f"param:{k}": v for k, v in fields.items()}}
        return local.post("/dags/web_params/trigger", data=data)

    answer = trigger(who="deferral", times="5", colour='"green"')
    assert answer.status_code == 303
    local.get(answer.headers["location"])  # its flash shown
    (run,) = runs_of(sessions, "web_params")
    assert run.conf == {"who": "deferral", "times": 5, "colour": "green"}
    # A value the schema refuses, or one that is not a number, names the param; no run is made.
    for bad, said in (({"times": "0"}, "times"), ({"times": "many"}, "times")):
        refused = trigger(**bad)
        assert refused.status_code == 303
        shown = local.get(refused.headers["location"]).text
        assert f"param &#39;{said}&#39;" in shown, re.findall(r"class=\"flash[^<]*", shown)
    assert len(runs_of(sessions, "web_params")) == 1


NAMED_DAG = """
from deferral import DAG
from deferral.operators import EmptyOperator

with DAG(
    "web_named",
    schedule=None,
    dag_display_name="Nightly load",
    owner_links={"data-team": "https://wiki.example/data-team"},
):
    EmptyOperator(task_id="extract", task_display_name="Extract orders", owner="data-team")
"""


def test_display_names_and_owner_links_show_where_airflow_shows_them(
    local: TestClient, write_dag: Callable[[str, str], Path]
) -> None:
    write_dag("web_named", NAMED_DAG)
    page = local.get("/dags/web_named").text
    assert "<h1>DAG Nightly load" in page and '<span class="muted" id="dag-id">web_named' in page
    assert (
        '<a href="https://wiki.example/data-team" rel="noopener noreferrer">data-team</a>' in page
    )
    assert ">Extract orders</text>" in page  # the graph's box
    assert ">Nightly load</a>" in local.get("/dags").text


def test_the_dag_list_searches_and_triggers_with_the_defaults(
    local: TestClient,
    sessions: sessionmaker[Session],
    write_dag: Callable[[str, str], Path],
) -> None:
    write_dag("search_orders", "from deferral import DAG\ndag = DAG('search_orders')\n")
    write_dag(
        "search_other",
        "from deferral import DAG\ndag = DAG('search_other', dag_display_name='Nightly ORDERS')\n",
    )
    write_dag("search_unrelated", "from deferral import DAG\ndag = DAG('search_unrelated')\n")
    found = local.get("/api/v1/dags", params={"search": "orders"}).json()
    assert {dag["dag_id"] for dag in found["dags"]} == {"search_orders", "search_other"}
    page = local.get("/dags", params={"search": "ORDERS"})
    assert 'value="ORDERS"' in page.text and "search_unrelated" not in page.text
    assert "No DAG matches that search." in local.get("/dags?search=zzz-none").text
    # Each listed DAG has a trigger button: a run with the params' defaults, then its page.
    log_in(local)
    listed = local.get("/dags", params={"search": "search_orders"}).text
    assert 'action="/dags/search_orders/trigger"' in listed
    answer = local.post("/dags/search_orders/trigger", data={"csrf_token": csrf_of(local, "/dags")})
    assert answer.status_code == 303 and answer.headers["location"].startswith(
        "/dags/search_orders?run_id=manual__"
    )
    assert [run.run_type for run in runs_of(sessions, "search_orders")] == ["manual"]


def test_readiness_says_not_ready_while_the_database_does_not_answer(
    exposed: TestClient, settings: Settings
) -> None:
    assert exposed.get("/api/v1/ready").json() == {"status": "ready"}  # no login needed
    (port,) = free_ports(1)
    nowhere = dataclasses.replace(
        settings, database_url=f"postgresql+psycopg://postgres@127.0.0.1:{port}/none"
    )
    with TestClient(create_app(nowhere, host="0.0.0.0", environ={})) as client:
        answer = client.get("/api/v1/ready")
        assert answer.status_code == 503
        assert answer.json()["status"] == "not ready"
        assert "Connection refused" in answer.json()["reason"]
        assert client.get("/api/v1/health").json() == {"status": "ok"}  # alive all the same
