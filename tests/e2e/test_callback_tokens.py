"""Callback tokens through real services (scheduler, worker, ``deferral webserver``): a task
templates its callback URL into a field, prints and logs it, pushes it as an XCom and fails
its first try with it in the error; the external job (this test) gets the real URL, and
nothing a reader can see holds either try's token: rendered fields through the API and the
task page, ``deferral tasks render``, task logs, XComs, service logs and the webserver's access
log. The first try's token is refused once the second try waits; the second's resumes it."""

from __future__ import annotations

import http.client
import json
from pathlib import Path
from urllib.parse import urlencode, urlsplit

import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from deferral.store.tables import TaskInstance
from deferral_cli.embedded import free_port
from tests.e2e.conftest import Services, command
from tests.helpers import wait_for

pytestmark = pytest.mark.e2e

DAG_ID = "e2e_callback_tokens"
DAG = """
import datetime as dt
import logging
from pathlib import Path

from deferral import DAG, BaseOperator
from deferral.triggers import CallbackTrigger

JOBS = Path({jobs!r})


class StartsJob(BaseOperator):
    template_fields = ("command", "env")

    def __init__(self, *, command, env, **kwargs):
        super().__init__(**kwargs)
        self.command, self.env = command, env

    def execute(self, context):
        url, try_number = context["callback"].url, context["ti"].try_number
        (JOBS / f"try-{{try_number}}").write_text(self.env["CALLBACK_URL"])  # the job's copy
        print(f"starting {{self.command}}")
        logging.getLogger("job").info("the job answers at %s", url)
        context["ti"].xcom_push("callback_url", url)
        if try_number == 1:
            raise RuntimeError(f"the job did not start; it would have called {{url}}")
        self.defer(trigger=CallbackTrigger(), method_name="done")

    def done(self, context, event):
        return event


with DAG({dag_id!r}, default_args={{"retries": 1, "retry_delay": dt.timedelta(0)}}):
    StartsJob(
        task_id="job",
        command="run-job --notify {{{{ callback.url }}}}",
        env={{"CALLBACK_URL": "{{{{ callback.url }}}}", "TOKEN": "{{{{ callback.token }}}}"}},
    )
"""


class Web:
    def __init__(self, port: int) -> None:
        self.port = port

    def request(self, method: str, path: str, body: object = None) -> tuple[int, str]:
        connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        try:
            headers = {"content-type": "application/json"} if body is not None else {}
            data = None if body is None else json.dumps(body).encode()
            connection.request(method, path, body=data, headers=headers)
            answer = connection.getresponse()
            return answer.status, answer.read().decode(errors="replace")
        finally:
            connection.close()

    def answers(self) -> bool:
        try:
            return self.request("GET", "/api/v1/health")[0] == 200
        except OSError:
            return False


def _try_and_state(sessions: sessionmaker[Session]) -> tuple[int, str] | None:
    with sessions() as session:
        row = session.execute(
            select(TaskInstance.try_number, TaskInstance.state).where(TaskInstance.dag_id == DAG_ID)
        ).one_or_none()
        return None if row is None else (row.try_number, row.state)


def _assert_no_token(text: str, tokens: list[str], where: str) -> None:
    for token in tokens:
        assert token not in text, f"a callback token in {where}: {text[:3000]}"


def test_callback_tokens_are_shown_nowhere_and_answer_only_their_try(
    services: Services, dags_folder: Path, tmp_path: Path, sessions: sessionmaker[Session]
) -> None:
    jobs = tmp_path / "jobs"
    jobs.mkdir()
    dag_file = dags_folder / "e2e_callback_tokens_dag.py"
    dag_file.write_text(DAG.format(jobs=str(jobs), dag_id=DAG_ID))
    port = free_port()
    env = {**services.env, "DEFERRAL_CALLBACK_BASE_URL": f"http://127.0.0.1:{port}"}
    services.env.update(env)  # the worker makes the URLs, the CLI renders with the same base
    services.spawn("webserver", command("deferral", "webserver", "--port", str(port)), env)
    services.start("scheduler")
    services.start("worker")
    web = Web(port)
    wait_for(web.answers, timeout=180, what="the webserver")
    done = services.run("dags", "trigger", DAG_ID, "--run-id", "r1")
    assert done.returncode == 0, done.stdout + done.stderr

    wait_for(
        lambda: _try_and_state(sessions) == (2, "deferred"),
        timeout=240,
        what="the task's second try to wait for its callback",
    )
    urls = [(jobs / f"try-{n}").read_text() for n in (1, 2)]
    tokens = [url.rsplit("/", 1)[1] for url in urls]
    assert all(url.startswith(f"http://127.0.0.1:{port}/api/v1/callbacks/") for url in urls)
    assert tokens[0] != tokens[1]

    # -- a reader sees no token: the web UI and its API, the CLI, the logs
    task = urlencode({"run_id": "r1", "task_id": "job"})
    reads = [
        f"/dags/{DAG_ID}/task_instance?{task}",
        f"/api/v1/dags/{DAG_ID}/task_instance?{task}",
        *[f"/api/v1/dags/{DAG_ID}/task_instance/log?{task}&try_number={n}" for n in (1, 2)],
        f"/dags/{DAG_ID}",
        f"/api/v1/dags/{DAG_ID}",
        "/deferred",
    ]
    pages = {path: web.request("GET", path) for path in reads}
    for path, (status, text) in pages.items():
        assert status == 200, (path, text[:500])
        _assert_no_token(text, tokens, path)
    rendered = pages[f"/api/v1/dags/{DAG_ID}/task_instance?{task}"][1]
    assert f"run-job --notify http://127.0.0.1:{port}/api/v1/callbacks/***" in rendered
    commands = (
        ("tasks", "render", DAG_ID, "r1", "job"),
        ("tasks", "render", DAG_ID, "r1", "job", "--try", "1"),
        ("tasks", "logs", DAG_ID, "r1", "job", "--try", "1"),
        ("tasks", "logs", DAG_ID, "r1", "job"),
        ("xcom", "list", DAG_ID, "r1"),
        ("xcom", "get", DAG_ID, "r1", "job", "--key", "callback_url"),
        ("runs", "show", DAG_ID, "r1", "--history"),
        ("signals", "list"),
        ("triggers", "list"),
    )
    outputs = {" ".join(args): services.run(*args) for args in commands}
    for said, run in outputs.items():
        assert run.returncode == 0, (said, run.stdout + run.stderr)
        _assert_no_token(run.stdout + run.stderr, tokens, f"`deferral {said}`")
    render = outputs[f"tasks render {DAG_ID} r1 job"].stdout
    assert "/api/v1/callbacks/***" in render and '"TOKEN": "***"' in render
    first_log = outputs[f"tasks logs {DAG_ID} r1 job --try 1"].stdout
    assert "the job answers at http://127.0.0.1" in first_log
    assert "it would have called http://127.0.0.1:" in first_log

    # -- the first try's token cannot answer the second try; the second's own token does
    first, second = (urlsplit(url).path for url in urls)
    status, text = web.request("POST", first, {"status": "success", "payload": "from try 1"})
    assert status == 409 and "no longer waits" in text, text
    status, text = web.request("POST", second, {"status": "success", "payload": {"rows": 42}})
    assert (status, json.loads(text)) == (200, {"resumed": 1})
    wait_for(lambda: _try_and_state(sessions) == (2, "success"), timeout=240, what="success")
    returned = services.run("xcom", "get", DAG_ID, "r1", "job")
    assert json.loads(returned.stdout) == {"rows": 42}, returned.stdout + returned.stderr

    access = services.log("webserver")
    assert 'POST /api/v1/callbacks/*** HTTP/1.1" 409' in access
    assert 'POST /api/v1/callbacks/*** HTTP/1.1" 200' in access
    for name in ("webserver", "scheduler", "worker"):
        _assert_no_token(services.log(name), tokens, f"the {name}'s log")
