"""Bad input fails the one task it concerns, with a message naming the fault, and nothing else."""

from __future__ import annotations

from typing import Any

import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from broker.client import Broker
from deferral.store.tables import TaskInstance, TaskStateChange
from tests.e2e.conftest import CLI, Services
from tests.helpers import wait_for

pytestmark = pytest.mark.e2e

BAD_DAG = """
import datetime as dt

from deferral import DAG, BaseOperator
from deferral.operators import PythonOperator
from deferral.triggers import TimeDeltaTrigger


class DefersBadKwarg(BaseOperator):
    def execute(self, context):
        self.defer(
            trigger=TimeDeltaTrigger(dt.timedelta(seconds=1)),
            method_name="resume",
            kwargs={"handle": object()},
        )

    def resume(self, context, event, handle):
        return "unreachable"


class WaitsLong(BaseOperator):
    def execute(self, context):
        self.defer(trigger=TimeDeltaTrigger(dt.timedelta(minutes=10)), method_name="resume")

    def resume(self, context, event):
        return "resumed"


with DAG("e2e_bad") as dag:
    DefersBadKwarg(task_id="bad_kwarg")
    WaitsLong(task_id="waits")
    PythonOperator(task_id="healthy", python_callable=lambda: "fine")
"""


def _ti(sessions: sessionmaker[Session], task_id: str) -> TaskInstance | None:
    with sessions() as session:
        return session.scalars(select(TaskInstance).where(TaskInstance.task_id == task_id)).first()


def _last_reason(sessions: sessionmaker[Session], ti_id: int) -> str:
    with sessions() as session:
        reason = session.scalars(
            select(TaskStateChange.reason)
            .where(TaskStateChange.task_instance_id == ti_id)
            .order_by(TaskStateChange.id.desc())
        ).first()
    return reason or ""


def _xadd(broker: Broker, stream: str, fields: dict[str, str]) -> None:
    """What someone writing to Redis by hand does: a plain XADD, no index, no MAC."""
    broker.redis.execute_command("XADD", stream, "*", *[x for kv in fields.items() for x in kv])


def test_forged_and_malformed_entries_are_dead_lettered_and_change_nothing(
    services: Services, write_dag: Any, sessions: sessionmaker[Session], broker: Broker
) -> None:
    write_dag("e2e_bad_dag", BAD_DAG)
    # A queue entry that is not a task attempt is dead-lettered before anything runs.
    _xadd(broker, broker.keys.queue("default"), {"task_instance_id": "seven"})
    services.start("scheduler")
    services.start("worker", "--concurrency", "2")
    services.start("triggerer")
    assert services.run("dags", "trigger", "e2e_bad").returncode == 0

    # A kwarg that cannot be serialized is refused at defer time, naming the key and its type.
    bad = wait_for(
        lambda: (ti := _ti(sessions, "bad_kwarg")) and ti.state == "failed" and ti, timeout=60
    )
    assert "defer kwargs['handle'] has unsupported type object" in _last_reason(sessions, bad.id)

    waits = wait_for(
        lambda: (ti := _ti(sessions, "waits")) and ti.state == "deferred" and ti, timeout=60
    )
    history = _history(sessions, waits.id)
    trigger = str(waits.trigger_id)
    # Entries written by hand name the deferred task: none of them may touch it.
    _xadd(
        broker,
        broker.keys.triggers,
        {"trigger_id": trigger, "classpath": "os.system", "task": "x", "token": "gAAAAAB-no"},
    )
    event = {"trigger_id": trigger, "dedup_key": "any", "kind": "event", "payload": '"go"'}
    _xadd(broker, broker.keys.events, {**event, "triggerer": "me", "mac": "forged"})
    failure = {**event, "kind": "failure", "payload": '{"message": "boom"}', "triggerer": "me"}
    _xadd(broker, broker.keys.events, {**failure, "mac": "AAAA"})
    _xadd(
        broker,
        broker.keys.queue("default"),
        {"task_instance_id": str(2**63), "try_number": "1", "task": "x", "mac": "m"},
    )
    dead = wait_for(
        lambda: len(entries := broker.xrange(broker.keys.dead)) == 5 and entries,
        timeout=60,
        what="five dead letters",
    )
    errors = sorted(entry.fields[b"error"].decode() for entry in dead)
    assert errors[0].startswith("bad event entry: EventMessage failed authentication")
    assert errors[1].startswith("bad event entry: EventMessage failed authentication")
    assert errors[2].startswith("bad queue entry: malformed QueueMessage")
    assert (
        errors[3] == f"bad queue entry: task_instance_id {2**63} is out of range (1..{2**63 - 1})"
    )
    assert "rejected trigger entry: token failed authentication" in errors[4]

    # The named task is untouched: still deferred on its trigger, no new transition.
    still = _ti(sessions, "waits")
    assert still is not None and still.state == "deferred" and still.trigger_id == waits.trigger_id
    assert _history(sessions, waits.id) == history
    # Everything else carried on (the healthy task ends when it ends: waited for, not raced with
    # the dead letters), and every service is up.
    wait_for(
        lambda: (ti := _ti(sessions, "healthy")) is not None and ti.state == "success",
        timeout=60,
        what="the healthy task to succeed",
    )
    assert all(proc.poll() is None for proc in services.procs.values())


def _history(sessions: sessionmaker[Session], ti_id: int) -> list[tuple[str, str]]:
    with sessions() as session:
        return [
            (row.from_state, row.to_state)
            for row in session.execute(
                select(TaskStateChange.from_state, TaskStateChange.to_state)
                .where(TaskStateChange.task_instance_id == ti_id)
                .order_by(TaskStateChange.id)
            )
        ]


def test_a_missing_setting_stops_each_service_with_one_line_naming_it(
    services: Services,
) -> None:
    env = {k: v for k, v in services.env.items() if k != "DEFERRAL_FERNET_KEY"}
    for name in ("scheduler", "worker", "triggerer"):
        done = CLI.run(["consume"], env, timeout=60, script=name)
        assert done.returncode == 2, done.stderr
        assert done.stderr.strip().splitlines() == ["error: DEFERRAL_FERNET_KEY is not set"]

    malformed = {**services.env, "DEFERRAL_HEARTBEAT_SEC": "soon"}
    done = CLI.run(["consume"], malformed, timeout=60, script="triggerer")
    assert done.returncode == 2
    assert done.stderr.strip().startswith("error: DEFERRAL_HEARTBEAT_SEC is malformed")
    assert len(done.stderr.strip().splitlines()) == 1
