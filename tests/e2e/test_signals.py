"""Signals and callbacks through real processes, with no triggerer running: a wait costs a
row, the send resumes it, the scheduler queues it, the worker finishes it."""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable
from pathlib import Path

import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from deferral import signals
from deferral.runtime.crypto import Cipher
from deferral.store.callback_tokens import read_token
from deferral.store.metastore import metastore
from deferral.store.tables import TaskInstance
from deferral.store.xcom import DatabaseXComs
from tests.e2e.conftest import Services, shared_stack_fixtures
from tests.helpers import wait_for

pytestmark = pytest.mark.e2e

DAGS = """
from deferral import DAG, BaseOperator
from deferral.triggers import CallbackTrigger


class WaitForSignal(BaseOperator):
    def execute(self, context):
        self.wait_for_signal("e2e-key")

    def execute_complete(self, context, event):
        return event


class WaitForCallback(BaseOperator):
    def execute(self, context):
        context["ti"].xcom_push("callback_url", context["callback"].url)
        self.defer(trigger=CallbackTrigger(), method_name="done")

    def done(self, context, event):
        return {"answered": event}


with DAG("e2e_signals"):
    WaitForSignal(task_id="signal")
    WaitForCallback(task_id="callback")
"""

stack, services, sessions, write_dag = shared_stack_fixtures(("scheduler",), ("worker",))


def _state(sessions: sessionmaker[Session], task_id: str) -> str | None:
    with sessions() as session:
        return session.scalar(select(TaskInstance.state).where(TaskInstance.task_id == task_id))


def test_signal_and_callback_resume_tasks_without_a_triggerer(
    services: Services,
    sessions: sessionmaker[Session],
    write_dag: Callable[[str, str], Path],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    write_dag("e2e_signals", DAGS)
    for name in ("DEFERRAL_DATABASE_URL", "DEFERRAL_FERNET_KEY"):
        monkeypatch.setenv(name, services.env[name])
    wait_for(
        lambda: services.run("dags", "trigger", "e2e_signals", "--run-id", "r1").returncode == 0,
        timeout=120,
        what="the DAG to be parsed and triggered",
    )
    wait_for(
        lambda: _state(sessions, "signal") == _state(sessions, "callback") == "deferred",
        timeout=120,
        what="both tasks to defer",
    )
    sent = services.run("signals", "send", "e2e-key", "--payload", '{"n": 1}')
    assert sent.returncode == 0 and "1 task(s) resumed" in sent.stdout, sent.stderr

    xcoms = DatabaseXComs(sessions)
    url = xcoms.pull("e2e_signals", "r1", "callback", "callback_url", None)
    assert isinstance(url, str) and url.startswith("http://localhost:8080/api/v1/callbacks/")
    token = url.rsplit("/", 1)[1]
    cipher = Cipher(services.env["DEFERRAL_FERNET_KEY"].split(","))
    claim = read_token(cipher, token, dt.datetime.now(dt.UTC))
    with metastore().sessions.begin() as session:
        answered = signals.answer_callback(session, cipher, claim, "success", "ok")
    assert len(answered.resumed) == 1

    wait_for(
        lambda: _state(sessions, "signal") == _state(sessions, "callback") == "success",
        timeout=120,
        what="both tasks to succeed",
    )
    assert xcoms.pull("e2e_signals", "r1", "signal", "return_value", None) == {"n": 1}
    assert xcoms.pull("e2e_signals", "r1", "callback", "return_value", None) == {"answered": "ok"}
