"""Approvals and deadline alerts against real processes: two scheduler replicas, one worker with
one slot, a webserver and a headless Chromium. Approve from the browser, reject from the API
(downstream skipped), choose a branch from the CLI, a response timeout takes the default option,
an approval waits while the worker and its pool are full; a run that misses its deadline runs the
callback exactly once with two schedulers. One stack serves the module."""

from __future__ import annotations

import base64
import json
import os
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver
from sqlalchemy import insert, select
from sqlalchemy.orm import Session, sessionmaker

from deferral.states import TaskState
from deferral.store.tables import DeadlineMiss, HITLDetail, Pool, TaskInstance, XCom
from deferral_cli.embedded import free_port
from tests.e2e.conftest import Stack, command
from tests.helpers import wait_for
from webserver import users

pytestmark = pytest.mark.e2e

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
ADMIN_PASSWORD = "approvals-admin-pass"

DAGS = """
import datetime as dt
from pathlib import Path

from deferral import DAG
from deferral.deadline import DeadlineAlert, DeadlineReference, SyncCallback
from deferral.operators import EmptyOperator
from deferral.operators.hitl import ApprovalOperator, HITLBranchOperator, HITLOperator
from deferral.sensors.filesystem import FileSensor

with DAG("hitl_approve") as approve_dag:
    ApprovalOperator(task_id="approve", subject="Ship {{ run_id }}?") >> EmptyOperator(
        task_id="publish"
    ) >> EmptyOperator(task_id="announce")

with DAG("hitl_branch") as branch_dag:
    choose = HITLBranchOperator(task_id="choose", subject="Which way?", options=["left", "right"])
    choose >> [EmptyOperator(task_id="left"), EmptyOperator(task_id="right")]

with DAG("hitl_timeout") as timeout_dag:
    HITLOperator(
        task_id="ask",
        subject="Pick one",
        options=["a", "b"],
        defaults="b",
        execution_timeout=dt.timedelta(seconds=2),
    ) >> EmptyOperator(task_id="after")

with DAG("hitl_full", params={"path": "/nonexistent"}) as full_dag:
    ApprovalOperator(task_id="approve", subject="Go?", pool="hitl_one", priority_weight=10)
    # Holds the only worker slot and the only pool slot until the test creates the file.
    FileSensor(task_id="busy", filepath="{{ params.path }}", poke_interval=0.2, pool="hitl_one")


def record_miss(context):
    with open(context["dag_id"] + ".calls", "a") as out:
        out.write(context["run_id"] + "\\n")


with DAG(
    "deadline_missed",
    params={"path": "/nonexistent"},
    deadline=DeadlineAlert(
        reference=DeadlineReference.DAGRUN_QUEUED_AT,
        interval=dt.timedelta(seconds=2),
        callback=SyncCallback(record_miss),
    ),
) as deadline_dag:
    FileSensor(task_id="slow", filepath="{{ params.path }}", poke_interval=0.2, mode="reschedule")
"""


class Env:
    def __init__(self, stack: Stack, driver: WebDriver, base: str) -> None:
        self.stack, self.driver, self.base = stack, driver, base

    @property
    def sessions(self) -> sessionmaker[Session]:
        return self.stack.sessions

    def trigger(self, dag_id: str, run_id: str, conf: dict[str, Any] | None = None) -> None:
        args = ["dags", "trigger", dag_id, "--run-id", run_id]
        if conf is not None:
            args += ["--conf", json.dumps(conf)]
        done = self.stack.services.run(*args)
        assert done.returncode == 0, done.stderr

    def ti(self, dag_id: str, run_id: str, task_id: str) -> TaskInstance | None:
        with self.sessions() as session:
            return session.scalar(
                select(TaskInstance).where(
                    TaskInstance.dag_id == dag_id,
                    TaskInstance.run_id == run_id,
                    TaskInstance.task_id == task_id,
                )
            )

    def state(self, dag_id: str, run_id: str, task_id: str) -> str | None:
        ti = self.ti(dag_id, run_id, task_id)
        return None if ti is None else ti.state

    def wait_state(self, dag_id: str, run_id: str, task_id: str, state: str) -> TaskInstance:
        wait_for(
            lambda: self.state(dag_id, run_id, task_id) == state,
            timeout=120,
            what=f"{dag_id}.{run_id}.{task_id} to be {state}",
        )
        ti = self.ti(dag_id, run_id, task_id)
        assert ti is not None
        return ti

    def xcom(self, ti_id: int) -> Any:
        with self.sessions() as session:
            return session.scalar(
                select(XCom.value).where(XCom.task_instance_id == ti_id, XCom.key == "return_value")
            )

    def detail(self, ti_id: int) -> HITLDetail:
        with self.sessions() as session:
            found = session.get(HITLDetail, ti_id)
            assert found is not None
            return found

    def api(self, path: str, body: Any | None = None) -> tuple[int, Any]:
        credentials = base64.b64encode(f"admin:{ADMIN_PASSWORD}".encode()).decode()
        request = urllib.request.Request(
            self.base + path,
            data=None if body is None else json.dumps(body).encode(),
            headers={"Authorization": f"Basic {credentials}", "Content-Type": "application/json"},
            method="GET" if body is None else "POST",
        )
        try:
            with urllib.request.urlopen(request, timeout=30) as answer:
                return answer.status, json.loads(answer.read())
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read())


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as answer:
            return bool(answer.status == 200)
    except OSError:
        return False


@pytest.fixture(scope="module")
def env(module_stack: Stack) -> Iterator[Env]:
    (module_stack.dags_folder / "hitl_dags.py").write_text(DAGS)
    with module_stack.sessions.begin() as session:
        session.execute(insert(Pool).values(name="hitl_one", slots=1))
    services = module_stack.services
    services.env[users.ADMIN_PASSWORD_ENV] = ADMIN_PASSWORD
    port = free_port()
    # The deadline callback writes into the schedulers' working directory.
    calls = module_stack.dags_folder.parent
    for name in ("scheduler", "scheduler2"):
        services.spawn(name, command("scheduler", "consume"), services.env, cwd=calls)
    services.start("worker", "--concurrency", "1")
    services.start("triggerer")
    services.spawn("webserver", command("deferral", "webserver", "--port", str(port)), services.env)
    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for argument in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu"):
        options.add_argument(argument)
    os.environ["SE_OFFLINE"] = "true"
    driver = webdriver.Chrome(service=Service(str(CHROMEDRIVER)), options=options)
    driver.implicitly_wait(0)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: _answers(base + "/api/v1/health"), timeout=180, what="the webserver")
        yield Env(module_stack, driver, base)
    finally:
        driver.quit()


def test_approve_from_the_browser(env: Env) -> None:
    env.trigger("hitl_approve", "browser")
    ti = env.wait_state("hitl_approve", "browser", "approve", TaskState.AWAITING_INPUT)
    assert env.state("hitl_approve", "browser", "publish") == TaskState.NONE
    driver = env.driver
    driver.get(env.base + "/login?next=/required_actions")
    driver.find_element(By.CSS_SELECTOR, "#username").send_keys("admin")
    driver.find_element(By.CSS_SELECTOR, "#password").send_keys(ADMIN_PASSWORD)
    driver.find_element(By.CSS_SELECTOR, "#login-form button[type=submit]").click()
    panel = f'.required-action[data-ti="{ti.id}"]'
    wait_for(lambda: driver.find_elements(By.CSS_SELECTOR, panel), timeout=30, what="the action")
    assert "Ship browser?" in driver.find_element(By.CSS_SELECTOR, panel).text  # rendered
    driver.find_element(By.CSS_SELECTOR, f'{panel} button[data-option="Approve"]').click()
    wait_for(lambda: driver.find_elements(By.CSS_SELECTOR, ".flash.ok"), timeout=30)

    env.wait_state("hitl_approve", "browser", "announce", TaskState.SUCCESS)
    assert env.state("hitl_approve", "browser", "approve") == TaskState.SUCCESS
    assert env.xcom(ti.id) == {"chosen_options": ["Approve"], "params_input": {}}
    detail = env.detail(ti.id)
    assert detail.responded_by == "admin" and detail.responded_at is not None


def test_reject_from_the_api_skips_downstream_and_bad_responses_are_refused(env: Env) -> None:
    env.trigger("hitl_approve", "api")
    ti = env.wait_state("hitl_approve", "api", "approve", TaskState.AWAITING_INPUT)
    status, listed = env.api("/api/v1/hitlDetails?dag_id=hitl_approve")
    assert status == 200
    assert [d["task_instance_id"] for d in listed["hitl_details"]] == [ti.id]
    assert listed["hitl_details"][0]["options"] == ["Approve", "Reject"]

    status, said = env.api(f"/api/v1/hitlDetails/{ti.id}", {"chosen_options": ["Maybe"]})
    assert status == 400 and said["error"].startswith("unknown option 'Maybe'")
    assert "\n" not in said["error"]
    status, said = env.api(
        f"/api/v1/hitlDetails/{ti.id}", {"chosen_options": ["Approve", "Reject"]}
    )
    assert status == 400 and "only one option" in said["error"]
    publish = env.ti("hitl_approve", "api", "publish")
    assert publish is not None
    status, said = env.api(f"/api/v1/hitlDetails/{publish.id}", {"chosen_options": ["Reject"]})
    assert status == 409 and "is not awaiting input (state none)" in said["error"]
    assert env.state("hitl_approve", "api", "approve") == TaskState.AWAITING_INPUT  # unharmed

    status, said = env.api(f"/api/v1/hitlDetails/{ti.id}", {"chosen_options": ["Reject"]})
    assert status == 200 and said["responded_by"] == "admin"
    status, said = env.api(f"/api/v1/hitlDetails/{ti.id}", {"chosen_options": ["Approve"]})
    assert status == 409 and "already responded to by admin" in said["error"]

    env.wait_state("hitl_approve", "api", "publish", TaskState.SKIPPED)
    env.wait_state("hitl_approve", "api", "announce", TaskState.SKIPPED)
    assert env.state("hitl_approve", "api", "approve") == TaskState.SUCCESS
    assert env.xcom(ti.id) == {"chosen_options": ["Reject"], "params_input": {}}


def test_the_cli_responds_to_a_branch(env: Env) -> None:
    env.trigger("hitl_branch", "cli")
    ti = env.wait_state("hitl_branch", "cli", "choose", TaskState.AWAITING_INPUT)
    listed = env.stack.services.run("approvals", "list", "--json")
    assert listed.returncode == 0 and any(r["id"] == ti.id for r in json.loads(listed.stdout))
    bad = env.stack.services.run("approvals", "respond", str(ti.id), "up")
    assert bad.returncode == 1
    assert bad.stderr.strip() == "error: unknown option 'up': expected one of ['left', 'right']"
    done = env.stack.services.run("approvals", "respond", str(ti.id), "left", "--as", "ops")
    assert done.returncode == 0, done.stderr
    env.wait_state("hitl_branch", "cli", "left", TaskState.SUCCESS)
    env.wait_state("hitl_branch", "cli", "right", TaskState.SKIPPED)
    assert env.detail(ti.id).responded_by == "ops"


def test_a_response_timeout_takes_the_default_option(env: Env) -> None:
    env.trigger("hitl_timeout", "timeout")
    ti = env.wait_state("hitl_timeout", "timeout", "after", TaskState.SUCCESS)
    ask = env.ti("hitl_timeout", "timeout", "ask")
    assert ask is not None and ask.state == TaskState.SUCCESS and ti is not None
    assert env.xcom(ask.id) == {"chosen_options": ["b"], "params_input": {}}
    detail = env.detail(ask.id)
    assert detail.responded_by is None and detail.chosen_options == ["b"]


def test_an_approval_waits_while_the_worker_and_its_pool_are_full(env: Env, tmp_path: Path) -> None:
    flag = tmp_path / "flag"
    env.trigger("hitl_full", "full", {"path": str(flag)})
    ti = env.wait_state("hitl_full", "full", "approve", TaskState.AWAITING_INPUT)
    # The worker's one slot and the pool's one slot now go to the sensor.
    env.wait_state("hitl_full", "full", "busy", TaskState.RUNNING)
    assert env.state("hitl_full", "full", "approve") == TaskState.AWAITING_INPUT
    flag.write_text("done")
    env.wait_state("hitl_full", "full", "busy", TaskState.SUCCESS)
    status, _ = env.api(f"/api/v1/hitlDetails/{ti.id}", {"chosen_options": ["Approve"]})
    assert status == 200
    env.wait_state("hitl_full", "full", "approve", TaskState.SUCCESS)


def test_a_missed_deadline_runs_its_callback_exactly_once_with_two_schedulers(
    env: Env, tmp_path: Path
) -> None:
    flag = tmp_path / "deadline_flag"
    env.trigger("deadline_missed", "late", {"path": str(flag)})

    def recorded() -> list[DeadlineMiss]:
        with env.sessions() as session:
            return list(session.scalars(select(DeadlineMiss)))

    wait_for(lambda: [m for m in recorded() if m.callback_state != "pending"], timeout=60)
    calls = env.stack.dags_folder.parent / "deadline_missed.calls"
    # Both replicas keep checking every second: a second call would come within a few checks.
    wait_for(lambda: env.state("deadline_missed", "late", "slow") is not None, timeout=10)
    flag.write_text("done")
    env.wait_state("deadline_missed", "late", "slow", TaskState.SUCCESS)
    misses = recorded()
    assert [(m.run_id, m.callback_state) for m in misses] == [("late", "done")]
    assert calls.read_text().splitlines() == ["late"]
    logs = env.stack.services.log("scheduler") + env.stack.services.log("scheduler2")
    assert logs.count("deadline missed by ['late']") == 1
    status, listed = env.api("/api/v1/deadlineMisses?dag_id=deadline_missed")
    assert status == 200 and [m["run_id"] for m in listed["deadline_misses"]] == ["late"]
    env.driver.get(env.base + "/deadline_misses")  # logged in by the first test
    row = env.driver.find_element(By.CSS_SELECTOR, '.deadline-miss[data-run="late"]')
    assert "deadline_missed" in row.text and "done" in row.text
