"""Signals and callbacks through real processes, with no triggerer running: a wait costs a
row, the send resumes it, the scheduler queues it, the worker finishes it. The last test starts
a triggerer: composite waits beside a trigger that must run."""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable
from pathlib import Path

import pytest
from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

from deferral import signals
from deferral.runtime.crypto import Cipher
from deferral.store import progress
from deferral.store.callback_tokens import read_token
from deferral.store.metastore import metastore
from deferral.store.tables import TaskInstance, TaskStateChange
from deferral.store.xcom import DatabaseXComs
from deferral_cli.embedded import free_port
from tests.e2e.conftest import Services, shared_stack_fixtures
from tests.e2e.test_metrics import scrape, value
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


COMPOSITE_TRIGGERS = """
import anyio
from deferral.triggers import BaseTrigger, TriggerEvent, TriggerProgress


class Steps(BaseTrigger):
    def serialize(self):
        return "e2e_composite_triggers.Steps", {}

    async def run(self):
        for step in range(1, 6):
            yield TriggerProgress({"step": step})
        yield TriggerEvent("stepped")


class Forever(BaseTrigger):
    def __init__(self, killed_file):
        super().__init__()
        self.killed_file = killed_file

    def serialize(self):
        return "e2e_composite_triggers.Forever", {"killed_file": self.killed_file}

    async def run(self):
        await anyio.sleep_forever()
        yield TriggerEvent(None)

    async def on_kill(self):
        with open(self.killed_file, "w") as f:
            f.write("killed")
"""

COMPOSITE_DAGS = """
import datetime as dt

from deferral import DAG, BaseOperator
from deferral.triggers import AllOf, AnyOf, SignalTrigger, TimeDeltaTrigger
from e2e_composite_triggers import Forever, Steps


class Waits(BaseOperator):
    def __init__(self, make, cancel_on=None, **kwargs):
        super().__init__(**kwargs)
        self.make, self.cancel_on = make, cancel_on

    def execute(self, context):
        self.defer(trigger=self.make(), method_name="done", cancel_on=self.cancel_on)

    def done(self, context, event):
        return event


with DAG("e2e_composite"):
    Waits(
        task_id="any_signal",
        make=lambda: AnyOf(
            signal=SignalTrigger("e2e-any"), timeout=TimeDeltaTrigger(dt.timedelta(hours=1))
        ),
    )
    Waits(
        task_id="any_timeout",
        make=lambda: AnyOf(
            signal=SignalTrigger("e2e-never"), timeout=TimeDeltaTrigger(dt.timedelta(seconds=3))
        ),
    )
    Waits(
        task_id="all_of",
        make=lambda: AllOf(
            a=SignalTrigger("e2e-a", where={{"ok": True}}), b=SignalTrigger("e2e-b")
        ),
    )
    Waits(
        task_id="cancelled",
        make=lambda: Forever({killed!r}),
        cancel_on=SignalTrigger("e2e-cancel", where={{"order": {{"in": [1, 2]}}}}),
    )
    Waits(task_id="progress", make=Steps)
"""


def test_composite_waits_run_nothing_and_cancel_on_kills_the_running_trigger(
    services: Services,
    sessions: sessionmaker[Session],
    write_dag: Callable[[str, str], Path],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    """Issue 33 through real processes: an any-of resumed by its signal, another timed out
    into its default by the scheduler's timer, an all-of after its two (filtered) signals, and a
    task on a running trigger cancelled by a matching signal (skipped, on_kill called). While
    they wait, the triggerer runs one trigger: the one that must run. A trigger reporting five
    steps then firing: five recorded (as the triggerer sent them, in order), one resume."""
    killed = tmp_path / "killed"
    write_dag("e2e_composite_triggers", COMPOSITE_TRIGGERS)
    write_dag("e2e_composite", COMPOSITE_DAGS.format(killed=str(killed)))
    for name in ("DEFERRAL_DATABASE_URL", "DEFERRAL_FERNET_KEY"):
        monkeypatch.setenv(name, services.env[name])
    port = free_port()
    services.start(
        "triggerer",
        "--metrics-port",
        str(port),
        env={"DEFERRAL_TRIGGER_MODULES": "deferral.triggers,e2e_composite_triggers"},
    )
    wait_for(
        lambda: services.run("dags", "trigger", "e2e_composite", "--run-id", "c1").returncode == 0,
        timeout=120,
        what="the DAG to be parsed and triggered",
    )
    tasks = ("any_signal", "all_of", "cancelled")
    wait_for(
        lambda: all(_state(sessions, t) == "deferred" for t in tasks),
        timeout=120,
        what="the tasks to defer",
    )
    running = wait_for(
        lambda: (s := scrape(port)) and value(s, "deferral_triggers_running") == 1,
        timeout=60,
        what="the triggerer to run the one trigger that must run",
    )
    assert running
    for key, payload in (("e2e-a", '{"ok": false}'), ("e2e-b", '"b"'), ("e2e-cancel", "3")):
        sent = services.run("signals", "send", key, "--payload", payload)
        assert sent.returncode == 0 and "0 task(s) resumed" in sent.stdout, sent.stderr
    assert signals.send("e2e-any", {"n": 1}).resumed
    assert signals.send("e2e-a", {"ok": True}).resumed
    assert signals.send("e2e-cancel", {"order": 2}).resumed
    wait_for(lambda: killed.exists(), timeout=60, what="the running trigger's on_kill")
    wait_for(
        lambda: (
            [_state(sessions, t) for t in ("any_signal", "any_timeout", "all_of", "cancelled")]
            == ["success", "success", "success", "skipped"]
        ),
        timeout=120,
        what="the composites to resume and the cancelled task to be skipped",
    )
    xcoms = DatabaseXComs(sessions)
    assert xcoms.pull("e2e_composite", "c1", "any_signal", "return_value", None) == {
        "fired": "signal",
        "payload": {"n": 1},
    }
    timed_out = xcoms.pull("e2e_composite", "c1", "any_timeout", "return_value", None)
    assert timed_out["fired"] == "timeout"
    assert xcoms.pull("e2e_composite", "c1", "all_of", "return_value", None) == {
        "fired": ["a", "b"],
        "payloads": {"a": {"ok": True}, "b": "b"},
    }
    assert "cancelled (reason: user_action)" in services.log("triggerer")
    wait_for(lambda: _state(sessions, "progress") == "success", timeout=60, what="progress")
    assert xcoms.pull("e2e_composite", "c1", "progress", "return_value", None) == "stepped"
    cipher = Cipher(services.env["DEFERRAL_FERNET_KEY"].split(","))
    with sessions() as session:
        ti_id = session.scalar(select(TaskInstance.id).where(TaskInstance.task_id == "progress"))
        assert ti_id is not None
        reports = progress.of_try(session, cipher, ti_id, 1)
        resumes = session.scalar(
            select(func.count()).where(
                TaskStateChange.task_instance_id == ti_id,
                TaskStateChange.from_state == "deferred",
                TaskStateChange.to_state == "scheduled",
            )
        )
    assert [r.payload for r in reports.kept] == [{"step": step} for step in range(1, 6)]
    assert resumes == 1
