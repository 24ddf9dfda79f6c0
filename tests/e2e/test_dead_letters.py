"""Dead letters handled by an operator on the real services: a trigger entry dead-lettered while
its task still waits is re-driven by `deferral dead retry` and its task finishes exactly once; a
stale or forged dead letter changes nothing and says why; the payload (a canary in the trigger's
kwargs) is never in clear, and `show --reveal` opens it."""

from __future__ import annotations

import json
import signal
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

from broker.client import Broker
from broker.consumer import StreamConsumer
from broker.streams import GROUP_TRIGGERERS, DeadLetterMessage, to_fields
from deferral.runtime.crypto import Cipher
from deferral.states import TaskState
from deferral.store.tables import ResumeEvent, TaskInstance
from tests.e2e.conftest import Services
from tests.helpers import wait_for

pytestmark = pytest.mark.e2e

CANARY = "canary-e2e-51d0"
SECRET = "s3cret-e2e-9a7b"

TRIGGERS_MODULE = """
from deferral.triggers import BaseTrigger, TriggerEvent


class Once(BaseTrigger):
    def __init__(self, marker, note, password):
        super().__init__()
        self.marker, self.note, self.password = marker, note, password

    def serialize(self):
        kwargs = {"marker": self.marker, "note": self.note, "password": self.password}
        return "e2e_dead_triggers.Once", kwargs

    async def run(self):
        with open(self.marker, "a") as runs:  # one line per run of this trigger
            runs.write("ran\\n")
        yield TriggerEvent("fired")
"""

DAG = """
from deferral import DAG, BaseOperator
from e2e_dead_triggers import Once


class Waits(BaseOperator):
    def execute(self, context, event=None):
        if event is None:
            marker = "{markers}/" + context["run_id"]
            self.defer(trigger=Once(marker, "{canary}", "{secret}"), method_name="execute")
        return event


with DAG("e2e_dead") as dag:
    Waits(task_id="waits")
"""


def _state(sessions: sessionmaker[Session], run_id: str) -> str | None:
    with sessions() as session:
        return session.scalar(
            select(TaskInstance.state).where(
                TaskInstance.dag_id == "e2e_dead", TaskInstance.run_id == run_id
            )
        )


def _dead_letter_all(broker: Broker, cipher: Cipher, count: int) -> dict[str, str]:
    """Dead-letter ``count`` trigger entries with the consumer core (as a triggerer that hit a
    fault would); {run id: dead letter id}."""
    consumer = StreamConsumer(
        broker,
        broker.keys.triggers,
        GROUP_TRIGGERERS,
        "faulty-triggerer",
        heartbeat_sec=1,
        max_deliveries=3,
        cipher=cipher,
    )
    consumer.start()
    deliveries = consumer.poll(count)
    assert len(deliveries) == count
    for delivery in deliveries:
        consumer.dead_letter(delivery, "injected transient fault: connection reset")
    return {
        entry.fields[b"task"].decode().split(".")[1]: entry.id
        for entry in broker.xrange(broker.keys.dead)
    }


def test_a_dead_trigger_entry_retried_resumes_its_task_once(
    services: Services,
    write_dag: Any,
    sessions: sessionmaker[Session],
    broker: Broker,
    cipher: Cipher,
    tmp_path: Path,
) -> None:
    markers = tmp_path / "markers"
    markers.mkdir()
    write_dag("e2e_dead_triggers", TRIGGERS_MODULE)
    write_dag("e2e_dead_dag", DAG.format(markers=markers, canary=CANARY, secret=SECRET))
    services.env["DEFERRAL_TRIGGER_MODULES"] = "deferral.triggers,e2e_dead_triggers"
    scheduler = services.start("scheduler")
    services.start("worker", "--concurrency", "2")
    for run_id in ("r1", "r2"):
        assert services.run("dags", "trigger", "e2e_dead", "--run-id", run_id).returncode == 0
    wait_for(
        lambda: all(_state(sessions, r) == TaskState.DEFERRED for r in ("r1", "r2")),
        timeout=90,
        what="both tasks deferred",
    )
    wait_for(lambda: broker.redis.xlen(broker.keys.triggers) == 2, timeout=30, what="2 entries")
    # No scheduler while the entries are dead: its reconciler would republish them.
    scheduler.send_signal(signal.SIGTERM)
    scheduler.wait(timeout=30)
    dead = _dead_letter_all(broker, cipher, 2)
    assert set(dead) == {"r1", "r2"}

    listed = services.run("dead", "list", "--json")
    assert listed.returncode == 0, listed.stderr
    records = json.loads(listed.stdout)
    assert {r["id"] for r in records} == set(dead.values())
    assert all(r["stream"] == broker.keys.triggers for r in records)
    raw = b"".join(k + v for e in broker.xrange(broker.keys.dead) for k, v in e.fields.items())
    assert CANARY.encode() not in raw and SECRET.encode() not in raw

    sealed = services.run("dead", "show", dead["r1"])
    assert sealed.returncode == 0, sealed.stderr
    assert "injected transient fault" in sealed.stdout and "faulty-triggerer" in sealed.stdout
    assert CANARY not in sealed.stdout and SECRET not in sealed.stdout
    opened = services.run("dead", "show", dead["r1"], "--reveal")
    assert opened.returncode == 0, opened.stderr
    assert CANARY in opened.stdout and SECRET not in opened.stdout

    # A forged dead letter (sealed with no key of ours) changes nothing and says why.
    forged = DeadLetterMessage(broker.keys.triggers, "1-1", "x", "1", "t", "c", "gAAAAforged")
    forged_id = broker.publish(broker.keys.dead, to_fields(forged))
    refused = services.run("dead", "retry", forged_id)
    assert refused.returncode == 1
    assert "unverified: its MAC does not hold" in refused.stderr
    assert broker.redis.xlen(broker.keys.triggers) == 0

    retried = services.run("dead", "retry", dead["r1"])
    assert retried.returncode == 0, retried.stderr
    assert retried.stdout.startswith(f"retried {dead['r1']}: now {broker.keys.triggers} ")
    twice = services.run("dead", "retry", dead["r1"])
    assert twice.returncode == 1 and "no dead letter" in twice.stderr
    assert broker.redis.xlen(broker.keys.triggers) == 1

    # r1 resumes from the retried entry; r2, never retried, from the reconciler's republish.
    services.start("scheduler")
    services.start("triggerer")
    wait_for(
        lambda: all(_state(sessions, r) == TaskState.SUCCESS for r in ("r1", "r2")),
        timeout=120,
        what="both tasks succeeded",
    )
    stale = services.run("dead", "retry", dead["r2"])
    assert stale.returncode == 1
    assert "stale: its task is success, no longer deferred on trigger" in stale.stderr
    assert broker.redis.xlen(broker.keys.triggers) == 0

    # Exactly once: one run of each trigger, one event applied, one try.
    assert (markers / "r1").read_text() == "ran\n"
    assert (markers / "r2").read_text() == "ran\n"
    with sessions() as session:
        assert session.scalar(select(func.count()).select_from(ResumeEvent)) == 2
        assert set(session.scalars(select(TaskInstance.try_number))) == {1}

    dropped = services.run("dead", "drop", dead["r2"], forged_id)
    assert dropped.returncode == 0, dropped.stderr
    assert broker.redis.xlen(broker.keys.dead) == 0
