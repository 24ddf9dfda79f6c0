"""Triggerer leases through real processes: a killed triggerer's triggers are taken over, a live
one's never are, a stopping one hands its triggers off, and one that lost an entry stops it."""

from __future__ import annotations

import signal
import time
from pathlib import Path
from typing import Any

import pytest
from redis.exceptions import ResponseError
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from broker.client import Broker
from broker.streams import GROUP_TRIGGERERS
from deferral.store.tables import TaskInstance, TaskStateChange, Triggerer
from tests.e2e.conftest import Services
from tests.helpers import wait_for

pytestmark = pytest.mark.e2e

DAG = """
import datetime as dt

from deferral import DAG, BaseOperator
from deferral.triggers import TimeDeltaTrigger


class Wait(BaseOperator):
    def __init__(self, *, seconds, **kwargs):
        super().__init__(**kwargs)
        self.seconds = seconds

    def execute(self, context):
        self.defer(
            trigger=TimeDeltaTrigger(dt.timedelta(seconds=self.seconds)), method_name="resume"
        )

    def resume(self, context, event):
        return "resumed"


with DAG("e2e_lease") as dag:
    Wait(task_id="wait", seconds={seconds})
"""


# A wait that ends when the test opens its gate (a file): a trigger held across a kill or a
# hand-off fires after the test has seen who holds it, not at a guessed moment a loaded machine
# may pass first.
GATE_TRIGGERS = """
import os

import anyio
from deferral.triggers import BaseTrigger, TriggerEvent


class Gate(BaseTrigger):
    def __init__(self, path):
        super().__init__()
        self.path = path

    def serialize(self):
        return "e2e_lease_triggers.Gate", {"path": self.path}

    async def run(self):
        while not os.path.exists(self.path):
            await anyio.sleep(0.05)
        yield TriggerEvent("opened")
"""

GATE_DAG = """
from deferral import DAG, BaseOperator
from e2e_lease_triggers import Gate


class Wait(BaseOperator):
    def execute(self, context):
        self.defer(trigger=Gate({gate!r}), method_name="resume")

    def resume(self, context, event):
        return "resumed"


with DAG("e2e_lease") as dag:
    Wait(task_id="wait")
"""


def _owners(broker: Broker) -> dict[str, tuple[str, int]]:
    """Pending trigger entries of every shard: id -> (owner, idle ms)."""
    return {i: held for pending in _pending(broker).values() for i, held in pending.items()}


def _pending(broker: Broker) -> dict[str, dict[str, tuple[str, int]]]:
    """Pending trigger entries by shard's stream: id -> (owner, idle ms); none before the
    group exists."""
    found = {}
    for stream in broker.keys.triggers_of("default"):
        try:
            reply = broker.redis.execute_command(
                "XPENDING", stream, GROUP_TRIGGERERS, "-", "+", 100
            )
        except ResponseError:  # NOGROUP: no triggerer has started yet
            continue
        found[stream] = {i.decode(): (owner.decode(), int(idle)) for i, owner, idle, _ in reply}
    return found


def _trigger_entries(broker: Broker) -> int:
    return sum(int(broker.redis.xlen(s)) for s in broker.keys.triggers_of("default"))


def _state(sessions: sessionmaker[Session]) -> str | None:
    with sessions() as session:
        return session.scalar(select(TaskInstance.state).where(TaskInstance.task_id == "wait"))


def _resumes(sessions: sessionmaker[Session]) -> int:
    with sessions() as session:
        reasons = session.scalars(
            select(TaskStateChange.reason).where(TaskStateChange.to_state == "scheduled")
        ).all()
    return sum(1 for r in reasons if r and r.startswith("trigger"))


def _deferred_on(services: Services, broker: Broker, owner: str) -> str:
    """Wait until the task's trigger entry is pending on ``owner``; return the entry id."""
    assert services.run("dags", "trigger", "e2e_lease").returncode == 0
    owners = wait_for(
        lambda: [i for i, (o, _) in _owners(broker).items() if o == owner],
        timeout=60,
        what=f"the trigger entry to be held by {owner}",
    )
    return owners[0]


def _start_core(services: Services, write_dag: Any, seconds: float) -> None:
    write_dag("e2e_lease_dag", DAG.format(seconds=seconds))
    services.start("scheduler")
    services.start("worker", "--concurrency", "2")


def _start_gated(services: Services, write_dag: Any, gate: Path) -> None:
    """The scheduler and a worker, the DAG's wait ending when ``gate`` exists."""
    write_dag("e2e_lease_triggers", GATE_TRIGGERS)
    write_dag("e2e_lease_dag", GATE_DAG.format(gate=str(gate)))
    services.env["DEFERRAL_TRIGGER_MODULES"] = "deferral.triggers,e2e_lease_triggers"
    services.start("scheduler")
    services.start("worker", "--concurrency", "2")


def test_a_killed_triggerers_trigger_is_taken_over_and_fires_once(
    services: Services,
    write_dag: Any,
    sessions: sessionmaker[Session],
    broker: Broker,
    tmp_path: Path,
) -> None:
    # The wait ends once the survivor has taken the entry over: fired before, it would be gone
    # before it is seen.
    gate = tmp_path / "gate"
    _start_gated(services, write_dag, gate)
    doomed = services.start("triggerer", "--name", "doomed", "--heartbeat", "0.5")
    entry_id = _deferred_on(services, broker, "doomed")
    stream = next(s for s, pending in _pending(broker).items() if entry_id in pending)
    doomed.kill()  # SIGKILL: no cleanup, no hand-off
    doomed.wait()
    services.start("triggerer2", "--name", "survivor", "--heartbeat", "0.5")

    wait_for(
        lambda: _owners(broker).get(entry_id, ("",))[0] == "survivor",
        timeout=30,
        what="the survivor to take the entry over",
    )
    gate.touch()
    wait_for(lambda: _state(sessions) == "success", timeout=60, what="the task to succeed")
    # Taken with the others, or alone as a suspect when the kill came before it ran a heartbeat.
    said = services.log("triggerer2")
    assert (
        f"took over 1 entr(ies) of {stream}" in said
        or f"took over suspect entry {entry_id} of {stream} from doomed" in said
    )
    assert _resumes(sessions) == 1
    assert _owners(broker) == {} and _trigger_entries(broker) == 0


def test_live_triggerers_renew_their_leases_so_nothing_is_taken_over(
    services: Services, write_dag: Any, sessions: sessionmaker[Session], broker: Broker
) -> None:
    # The wait (4 s) is over six times the takeover threshold (2.1 x 0.3 s).
    _start_core(services, write_dag, seconds=4)
    services.start("triggerer", "--name", "a", "--heartbeat", "0.3")
    services.start("triggerer2", "--name", "b", "--heartbeat", "0.3")
    assert services.run("dags", "trigger", "e2e_lease").returncode == 0
    wait_for(lambda: _state(sessions) == "success", timeout=60, what="the task to succeed")
    assert "took over" not in services.log("triggerer") + services.log("triggerer2")
    assert _resumes(sessions) == 1


def test_a_stopping_triggerer_hands_its_triggers_off_at_once(
    services: Services,
    write_dag: Any,
    sessions: sessionmaker[Session],
    broker: Broker,
    tmp_path: Path,
) -> None:
    gate = tmp_path / "gate"  # opened once the hand-off has been seen
    _start_gated(services, write_dag, gate)
    leaving = services.start("triggerer", "--name", "leaving", "--heartbeat", "1")
    entry_id = _deferred_on(services, broker, "leaving")
    services.start("triggerer2", "--name", "staying", "--heartbeat", "1")
    services.wait_up("triggerer2")  # the peer

    leaving.send_signal(signal.SIGTERM)
    assert leaving.wait(timeout=30) == 0
    exited = time.monotonic()
    owner, idle = _owners(broker)[entry_id]
    # Handed off: it looks idle far longer than it existed, so the peer takes it at once. (Not
    # handed off, it would read idle < 1 s here and wait for the 2.1 s threshold.)
    assert owner == "staying" or idle > 60_000, (owner, idle)
    wait_for(
        lambda: _owners(broker)[entry_id][0] == "staying",
        timeout=30,
        what="the peer to take the trigger",
    )
    # Running again on the peer within a second of the exit (its takeover scan: H / 4).
    assert time.monotonic() - exited <= 1.0
    assert "cancelled (reason: shutdown)" in services.log("triggerer")
    assert "triggerer leaving: received SIGTERM, stopping: cancelling 1 trigger(s)" in (
        services.log("triggerer")
    )
    gate.touch()
    wait_for(lambda: _state(sessions) == "success", timeout=60, what="the task to succeed")
    assert _resumes(sessions) == 1


def test_a_triggerer_that_lost_its_entry_stops_that_trigger(
    services: Services, write_dag: Any, sessions: sessionmaker[Session], broker: Broker
) -> None:
    _start_core(services, write_dag, seconds=120)
    services.start("triggerer", "--name", "holder", "--heartbeat", "0.3")
    entry_id = _deferred_on(services, broker, "holder")
    # A registered, live peer takes the entry (as after a missed lease). An unregistered name
    # would not count: the holder takes an entry back from a name no process has.
    with sessions.begin() as session:
        session.add(Triggerer(name="thief", hostname="h", pid=1, capacity=10, state="running"))
    broker.redis.execute_command(
        "XCLAIM", broker.keys.triggers, GROUP_TRIGGERERS, "thief", 0, entry_id, "JUSTID"
    )
    # Noticed at its next lease renewal (one heartbeat, 0.3 s here); the bound is only slack for
    # a loaded machine: the trigger runs 120 s, so it was stopped, not finished.
    wait_for(
        lambda: "cancelled (reason: reassigned)" in services.log("triggerer"),
        timeout=60,
        what="the holder to stop the trigger",
    )
    assert _owners(broker)[entry_id][0] == "thief"  # and it did not steal it back


TIMEOUT_DAG = """
import datetime as dt

from deferral import DAG, BaseOperator
from deferral.triggers import TimeDeltaTrigger


class WaitTooLong(BaseOperator):
    def execute(self, context):
        self.defer(
            trigger=TimeDeltaTrigger(dt.timedelta(minutes=10)),
            method_name="resume",
            timeout=dt.timedelta(seconds=1),
        )

    def resume(self, context, event):
        return "unreachable"


with DAG("e2e_timeout") as dag:
    WaitTooLong(task_id="wait")
"""


def test_a_timed_out_deferral_fails_its_task_and_the_triggerer_drops_the_trigger(
    services: Services, write_dag: Any, sessions: sessionmaker[Session], broker: Broker
) -> None:
    write_dag("e2e_timeout_dag", TIMEOUT_DAG)
    services.start("scheduler")
    services.start("worker", "--concurrency", "1")
    services.start("triggerer", "--heartbeat", "0.3")
    assert services.run("dags", "trigger", "e2e_timeout").returncode == 0

    wait_for(lambda: _state(sessions) == "failed", timeout=60, what="the task to fail")
    with sessions() as session:
        changes = session.execute(
            select(
                TaskStateChange.from_state, TaskStateChange.to_state, TaskStateChange.reason
            ).order_by(TaskStateChange.id)
        ).all()
    assert ("deferred", "scheduled", "trigger timeout passed") in [tuple(c) for c in changes]
    assert (changes[-1].to_state, changes[-1].reason) == (
        "failed",
        "TaskDeferralTimeout: the deferral timed out before its trigger fired",
    )
    wait_for(
        lambda: "cancelled (reason: timeout)" in services.log("triggerer"),
        timeout=10,
        what="the triggerer to drop the trigger",
    )
    wait_for(lambda: _trigger_entries(broker) == 0, what="the entry to go")
    assert _owners(broker) == {}
