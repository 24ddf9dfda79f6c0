"""DAG files as Airflow has them, through the real processes: a zipped DAG whose operator defers
on a trigger defined in the same zip runs to success (the worker child and the triggerer both
import from the archive), and a task_policy's retries are applied to a failing task."""

from __future__ import annotations

import textwrap
import uuid
import zipfile
from pathlib import Path

import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from deferral.runtime import serialization
from deferral.store.tables import SerializedDag, TaskInstance, TaskStateChange, XCom
from tests.e2e.conftest import Services
from tests.helpers import wait_for

pytestmark = pytest.mark.e2e

ZIPPED_DAG = """
from deferral import DAG, BaseOperator
from {helpers}.greeting import greet
from {triggers} import Echo


class AsksTheTrigger(BaseOperator):
    def execute(self, context):
        self.defer(trigger=Echo(greet("zip")), method_name="answered")

    def answered(self, context, event):
        return event


with DAG("e2e_zipped") as dag:
    AsksTheTrigger(task_id="ask")
"""

ZIPPED_TRIGGER = """
from deferral.triggers import BaseTrigger, TriggerEvent
from deferral.triggers.base import classpath_of


class Echo(BaseTrigger):
    def __init__(self, text):
        super().__init__()
        self.text = text

    def serialize(self):
        return classpath_of(Echo), {{"text": self.text}}

    async def run(self):
        yield TriggerEvent(self.text + " via {triggers}")
"""

LOCAL_SETTINGS = """
import datetime as dt


def task_policy(task):
    if task.dag.dag_id == "e2e_policed":
        task.retries = 2
        task.retry_delay = dt.timedelta(0)
"""

FAILING_DAG = """
from deferral import DAG
from deferral.operators import PythonOperator


def always_fails():
    raise RuntimeError("still broken")


with DAG("e2e_policed") as dag:
    PythonOperator(task_id="flaky", python_callable=always_fails)
"""


def _ti(sessions: sessionmaker[Session], task_id: str) -> TaskInstance | None:
    with sessions() as session:
        return session.scalars(select(TaskInstance).where(TaskInstance.task_id == task_id)).first()


def test_a_zipped_dag_defers_on_a_zipped_trigger_and_succeeds(
    services: Services, dags_folder: Path, sessions: sessionmaker[Session]
) -> None:
    suffix = uuid.uuid4().hex[:8]
    dag_module, triggers, helpers = f"zdag_{suffix}", f"ztriggers_{suffix}", f"zhelpers_{suffix}"
    with zipfile.ZipFile(dags_folder / "team.zip", "w") as archive:
        archive.writestr(
            f"{dag_module}.py",
            textwrap.dedent(ZIPPED_DAG.format(helpers=helpers, triggers=triggers)),
        )
        archive.writestr(
            f"{triggers}.py", textwrap.dedent(ZIPPED_TRIGGER.format(triggers=triggers))
        )
        archive.writestr(f"{helpers}/__init__.py", "")
        archive.writestr(f"{helpers}/greeting.py", "def greet(who):\n    return 'hello ' + who\n")
    services.env["DEFERRAL_TRIGGER_MODULES"] = f"deferral.triggers,{triggers}"
    services.start("scheduler")
    wait_for(
        lambda: _parsed(sessions, "e2e_zipped"), timeout=90, what="the scheduler to parse the zip"
    )
    listed = services.run("dags", "list")  # what the scheduler parsed
    assert listed.returncode == 0, listed.stderr
    assert "e2e_zipped" in listed.stdout and "team.zip" in listed.stdout
    services.start("worker")
    services.start("triggerer")
    assert services.run("dags", "trigger", "e2e_zipped").returncode == 0

    ti = wait_for(
        lambda: (ti := _ti(sessions, "ask")) and ti.state in ("success", "failed") and ti,
        timeout=90,
        what="the zipped task to finish",
    )
    assert ti.state == "success", services.log("triggerer")[-3000:]
    with sessions() as session:
        states = [c.to_state for c in session.scalars(select(TaskStateChange))]
        value = session.scalars(select(XCom.value).where(XCom.key == "return_value")).one()
    assert "deferred" in states
    assert serialization.from_jsonable(value) == f"hello zip via {triggers}"


def test_a_task_policys_retries_are_applied_to_a_failing_task(
    services: Services, dags_folder: Path, sessions: sessionmaker[Session]
) -> None:
    (dags_folder / "deferral_local_settings.py").write_text(textwrap.dedent(LOCAL_SETTINGS))
    (dags_folder / f"e2e_policed_{uuid.uuid4().hex[:8]}.py").write_text(FAILING_DAG)
    services.start("scheduler")
    services.start("worker")
    assert services.run("dags", "trigger", "e2e_policed").returncode == 0

    ti = wait_for(
        lambda: (ti := _ti(sessions, "flaky")) and ti.state == "failed" and ti,
        timeout=90,
        what="the task to fail for good",
    )
    assert ti.max_tries == 2
    assert ti.try_number == 3  # the first try and the policy's two retries
    with sessions() as session:
        retried = session.scalars(
            select(TaskStateChange).where(TaskStateChange.to_state == "up_for_retry")
        ).all()
    assert len(retried) == 2


def _parsed(sessions: sessionmaker[Session], dag_id: str) -> bool:
    with sessions() as session:
        return session.get(SerializedDag, dag_id) is not None
