"""The attack of a user allowed to send signals, who also reads the ``signal`` table and writes
to Redis, through the real processes: a signal payload crafted as a trigger spec (for a task
waiting on a timer, and for one waiting on a signal) or as a dead letter, XADDed by hand, runs
nothing, resumes nothing, is dead-lettered naming the failed check, and `deferral dead retry`
refuses it while `dead show` marks it unverified."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgspec
import pytest
from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

from broker.client import Broker
from broker.streams import DeadEntry, DeadLetterMessage, to_fields
from deferral.store.tables import ResumeEvent, Signal, TaskInstance
from tests.e2e.conftest import Services
from tests.helpers import wait_for

pytestmark = pytest.mark.e2e

DAG = """
import datetime as dt

from deferral import DAG, BaseOperator
from deferral.triggers import TimeDeltaTrigger


class WaitsLong(BaseOperator):
    def execute(self, context):
        self.defer(trigger=TimeDeltaTrigger(dt.timedelta(minutes=10)), method_name="resume")

    def resume(self, context, event):
        return "resumed"


class WaitsForSignal(BaseOperator):
    def execute(self, context):
        self.wait_for_signal("e2e-never-sent")

    def execute_complete(self, context, event):
        return event


with DAG("e2e_sealed"):
    WaitsLong(task_id="timer")
    WaitsForSignal(task_id="signal")
"""

FILE_TRIGGER = "deferral.triggers.file.FileTrigger"


def _deferred(sessions: sessionmaker[Session]) -> dict[str, TaskInstance]:
    with sessions() as session:
        tis = session.scalars(select(TaskInstance).where(TaskInstance.state == "deferred")).all()
        return {ti.task_id: ti for ti in tis}


def _sealed_signal(services: Services, sessions: sessionmaker[Session], payload: Any) -> str:
    """Send ``payload`` as a signal (any user may), then read it sealed from PostgreSQL."""
    sent = services.run("signals", "send", "e2e-other-key", "--payload", json.dumps(payload))
    assert sent.returncode == 0, sent.stderr
    with sessions() as session:
        return session.scalars(select(Signal.payload).order_by(Signal.id.desc()).limit(1)).one()


def _xadd(broker: Broker, stream: str, fields: dict[str, str]) -> str:
    flat = [x for kv in fields.items() for x in kv]
    return str(broker.redis.execute_command("XADD", stream, "*", *flat).decode())


def test_signal_payloads_crafted_as_specs_or_dead_letters_run_nothing(
    services: Services,
    write_dag: Any,
    sessions: sessionmaker[Session],
    broker: Broker,
    tmp_path: Path,
) -> None:
    write_dag("e2e_sealed_dag", DAG)
    services.start("scheduler")
    services.start("worker", "--concurrency", "2")
    services.start("triggerer")
    assert services.run("dags", "trigger", "e2e_sealed").returncode == 0
    waiting = wait_for(
        lambda: len(found := _deferred(sessions)) == 2 and found,
        timeout=120,
        what="both tasks to defer",
    )

    forged: dict[str, str] = {}
    for task_id, ti in waiting.items():
        label = f"{ti.dag_id}.{ti.run_id}.{ti.task_id}"
        # A FileTrigger on a directory that exists: run, it would resume the task at once.
        spec = {
            "trigger_id": ti.trigger_id,
            "classpath": FILE_TRIGGER,
            "kwargs": {"filepath": str(tmp_path)},
            "task_instance_id": ti.id,
            "task": label,
            "try_number": ti.try_number,
        }
        entry = {"trigger_id": str(ti.trigger_id), "classpath": FILE_TRIGGER, "task": label}
        forged[task_id] = _sealed_signal(services, sessions, spec)
        _xadd(broker, broker.keys.triggers, {**entry, "token": forged[task_id]})
    dead = wait_for(
        lambda: len(entries := broker.xrange(broker.keys.dead)) == 2 and entries,
        timeout=60,
        what="two dead letters",
    )
    for letter in dead:
        error = letter.fields[b"error"].decode()
        assert "rejected trigger entry: token failed authentication as a trigger spec" in error

    # The same token inside a signal payload crafted as a dead letter of that entry.
    timer = waiting["timer"]
    fields = {
        "trigger_id": str(timer.trigger_id),
        "classpath": FILE_TRIGGER,
        "task": f"{timer.dag_id}.{timer.run_id}.timer",
        "token": forged["timer"],
    }
    inner = DeadEntry(broker.keys.triggers, "1-1", fields, "x", 1)
    sealed = _sealed_signal(services, sessions, msgspec.to_builtins(inner))
    clear = DeadLetterMessage(broker.keys.triggers, "1-1", "x", "1", fields["task"], "t", sealed)
    crafted = _xadd(broker, broker.keys.dead, to_fields(clear))
    retried = services.run("dead", "retry", crafted)
    assert retried.returncode == 1
    assert f"{crafted} not retried: unverified: its MAC does not hold" in retried.stderr
    shown = services.run("dead", "show", "--reveal", crafted).stdout
    assert "unverified: not proven to be written by deferral, not opened" in shown
    listed = json.loads(services.run("dead", "list", "--json").stdout)
    assert {r["id"]: r["verified"] for r in listed} == {
        **{letter.id: True for letter in dead},
        crafted: False,
    }

    # Nothing ran or resumed: both tasks wait as they did, no event was applied, the triggerer
    # started no FileTrigger, and the only trigger entry left is the timer's own.
    assert {t: (ti.state, ti.trigger_id) for t, ti in _deferred(sessions).items()} == {
        t: ("deferred", ti.trigger_id) for t, ti in waiting.items()
    }
    with sessions() as session:
        assert session.scalar(select(func.count()).select_from(ResumeEvent)) == 0
    assert FILE_TRIGGER not in services.log("triggerer").replace("dead-lettering", "")
    assert all(proc.poll() is None for proc in services.procs.values())
