"""Hostile and poison stream entries through the real processes: entries of any shape, forged
delivery counts, and a trigger that kills its triggerer among fifty healthy ones, on a triggerer
restarted under the same name each time it dies."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from redis.exceptions import ResponseError
from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

from broker.client import Broker
from broker.streams import GROUP_SCHEDULERS, GROUP_TRIGGERERS, GROUP_WORKERS
from deferral.runtime.crypto import Cipher
from deferral.store.tables import TaskInstance, TaskStateChange
from tests.e2e.conftest import Services, fire_deferred
from tests.forks import ForkedProcess
from tests.helpers import wait_for

pytestmark = pytest.mark.e2e


def _states(sessions: sessionmaker[Session]) -> dict[str, str]:
    with sessions() as session:
        return dict(session.execute(select(TaskInstance.task_id, TaskInstance.state)).all())


def _dag_states(sessions: sessionmaker[Session]) -> dict[str, str]:
    """DAG id -> the state of its one task instance."""
    with sessions() as session:
        return dict(session.execute(select(TaskInstance.dag_id, TaskInstance.state)).all())


def _changes(sessions: sessionmaker[Session], from_state: str, to_state: str) -> dict[str, int]:
    """task id -> how many times it moved from ``from_state`` to ``to_state``."""
    with sessions() as session:
        rows = session.execute(
            select(TaskInstance.task_id, func.count())
            .join(TaskStateChange, TaskStateChange.task_instance_id == TaskInstance.id)
            .where(TaskStateChange.from_state == from_state, TaskStateChange.to_state == to_state)
            .group_by(TaskInstance.task_id)
        ).all()
    return dict(rows)


def _pending_counts(broker: Broker, stream: str, group: str) -> dict[str, int]:
    """Entry id -> its delivery count, for every pending entry (a page is plenty here); none
    before the group's first consumer has started and made it."""
    try:
        reply = broker.redis.execute_command("XPENDING", stream, group, "-", "+", 1000)
    except ResponseError:  # NOGROUP
        return {}
    return {item[0].decode(): int(item[3]) for item in reply or []}


# -- a poison trigger among fifty healthy ones, on supervised triggerers ---------------------------

HEALTHY = 50
HEARTBEAT = "0.5"

# The poison kills its triggerer most of a heartbeat into its run(), so that the healthy
# triggers started around it on that triggerer die with it, unproven.
BESIDE_TRIGGERS = """
import asyncio
import os

from deferral.triggers import BaseTrigger, TriggerEvent


class Sleeps(BaseTrigger):
    def serialize(self):
        return "e2e_beside_triggers.Sleeps", {}

    async def run(self):
        await asyncio.sleep(0.75)
        yield TriggerEvent("slept")


class KillsItsTriggerer(BaseTrigger):
    def serialize(self):
        return "e2e_beside_triggers.KillsItsTriggerer", {}

    async def run(self):
        await asyncio.sleep(0.45)
        os.kill(os.getpid(), 9)
        yield TriggerEvent(None)
"""

# The poison and fifty healthy tasks deferring a few seconds, in three kinds: a time delta and a
# moment (timers: no code of their own runs) and a trigger whose run() sleeps (it runs).
POISON_BESIDE_HEALTHY_DAG = """
import datetime as dt

from deferral import DAG, BaseOperator
from deferral.triggers import DateTimeTrigger, TimeDeltaTrigger
from e2e_beside_triggers import KillsItsTriggerer, Sleeps


class Poisoned(BaseOperator):
    def execute(self, context):
        self.defer(trigger=KillsItsTriggerer(), method_name="resume")

    def resume(self, context, event):
        return "unreachable"


class Waits(BaseOperator):
    def __init__(self, kind, **kwargs):
        super().__init__(**kwargs)
        self.kind = kind

    def execute(self, context):
        if self.kind == "time":
            trigger = TimeDeltaTrigger(dt.timedelta(seconds=3))
        elif self.kind == "date":
            trigger = DateTimeTrigger(dt.datetime.now(dt.timezone.utc) + dt.timedelta(seconds=3))
        else:
            trigger = Sleeps()
        self.defer(trigger=trigger, method_name="resume")

    def resume(self, context, event):
        return "fine"


with DAG("e2e_poison_beside_healthy", max_active_tasks=64) as dag:
    Poisoned(task_id="poisoned")
    for i in range({healthy}):
        Waits(("time", "date", "sleep")[i % 3], task_id=f"fine{{i:02d}}")
"""


class Supervisor:
    """Restarts each triggerer under its ``--name`` whenever it died, as compose's
    ``restart: always`` or systemd would; call :meth:`tend` often."""

    def __init__(self, services: Services, names: list[str]) -> None:
        self.services = services
        self.procs = {name: self._start(name) for name in names}
        self.deaths = 0

    def _start(self, name: str) -> ForkedProcess:
        return self.services.start(name, "--name", name, "--heartbeat", HEARTBEAT)

    def tend(self) -> None:
        for name, proc in self.procs.items():
            if proc.poll() is not None:
                self.deaths += 1
                self.procs[name] = self._start(name)


@pytest.mark.parametrize("triggerers", [2, 3])
def test_a_poison_trigger_beside_fifty_healthy_on_supervised_triggerers(
    services: Services,
    write_dag: Any,
    sessions: sessionmaker[Session],
    broker: Broker,
    triggerers: int,
) -> None:
    """However many triggerers take over or replay, one suspect runs at a time in the group:
    the poison alone is counted and dead-lettered, the healthy ones that died beside it are
    cleared by surviving once, and each healthy task succeeds once."""
    write_dag("e2e_beside_triggers", BESIDE_TRIGGERS)
    write_dag("e2e_poison_beside_dag", POISON_BESIDE_HEALTHY_DAG.format(healthy=HEALTHY))
    services.env["DEFERRAL_TRIGGER_MODULES"] = "deferral.triggers,e2e_beside_triggers"
    services.start("scheduler")
    services.start("worker", "--concurrency", "16")
    names = ["triggerer", *(f"triggerer{n}" for n in range(2, triggerers + 1))]
    supervisor = Supervisor(services, names)
    assert services.run("dags", "trigger", "e2e_poison_beside_healthy").returncode == 0
    started = broker.keys.started(broker.keys.triggers)
    most: dict[str, int] = {}  # entry id -> the most deliveries ever counted against it

    def settled() -> bool:
        supervisor.tend()
        for entry_id, count in broker.redis.hgetall(started).items():
            most[entry_id.decode()] = max(most.get(entry_id.decode(), 0), int(count))
        states = _states(sessions)
        return len(states) == HEALTHY + 1 and all(
            s in ("success", "failed") for s in states.values()
        )

    wait_for(settled, timeout=240, interval=0.1, what="every task to finish")
    states = _states(sessions)
    assert states.pop("poisoned") == "failed"
    assert set(states.values()) == {"success"}
    healthy = {f"fine{i:02d}": 1 for i in range(HEALTHY)}
    resumed = _changes(sessions, "deferred", "scheduled")
    resumed.pop("poisoned", None)  # resumed at its failure
    assert resumed == healthy
    assert _changes(sessions, "running", "success") == healthy
    (dead,) = broker.xrange(broker.keys.dead)
    assert dead.fields[b"deliveries"] == b"6"
    assert b"DEFERRAL_MAX_DELIVERIES=5" in dead.fields[b"error"]
    with sessions() as session:
        reason = session.scalar(
            select(TaskStateChange.reason)
            .join(TaskInstance, TaskInstance.id == TaskStateChange.task_instance_id)
            .where(TaskInstance.task_id == "poisoned", TaskStateChange.to_state == "failed")
        )
    assert reason is not None and "delivered 6 times" in reason, reason
    poison_entry = dead.fields[b"source_id"].decode()
    assert most.get(poison_entry) == 5  # each delivery it ran alone in, and killed
    healthy_most = {i: n for i, n in most.items() if i != poison_entry}
    assert max(healthy_most.values(), default=0) <= 2, healthy_most
    assert supervisor.deaths >= 6


# -- forged delivery counts -------------------------------------------------------------------

# Both entries stay held until the test has seen the forged counts handled: the wait is fired by
# the test (fire_deferred) and the running task runs until a gate file appears, instead of a
# guessed 25 s that a loaded machine could outlast or the test wait out in full.
FORGED_DAG = r"""
import datetime as dt
import os
import time

from deferral import DAG, BaseOperator
from deferral.operators import PythonOperator
from deferral.triggers import TimeDeltaTrigger


class Waits(BaseOperator):
    def execute(self, context):
        self.defer(trigger=TimeDeltaTrigger(dt.timedelta(hours=1)), method_name="resume")

    def resume(self, context, event):
        return "resumed"


def runs_until_released():
    while not os.path.exists({gate!r}):
        time.sleep(0.1)
    return "ran"


with DAG("e2e_forged_counts") as dag:
    Waits(task_id="deferred")
    PythonOperator(task_id="running", python_callable=runs_until_released)
"""


def _forge(broker: Broker, stream: str, group: str, entry_id: str) -> None:
    """Claim a held entry for a name no process has, with start evidence of 10 deaths."""
    broker.redis.execute_command(
        "XCLAIM", stream, group, "x", 0, entry_id, "RETRYCOUNT", 10, "IDLE", 3_600_000
    )
    broker.redis.hset(broker.keys.started(stream), entry_id, 10)


def _only_pending(broker: Broker, stream: str, group: str) -> str | None:
    counts = _pending_counts(broker, stream, group)
    return next(iter(counts)) if len(counts) == 1 else None


def test_a_forged_delivery_count_fails_nothing_and_is_logged(
    services: Services,
    write_dag: Any,
    sessions: sessionmaker[Session],
    broker: Broker,
    cipher: Cipher,
    tmp_path: Path,
) -> None:
    gate = tmp_path / "gate"
    write_dag("e2e_forged_dag", FORGED_DAG.format(gate=str(gate)))
    services.env["DEFERRAL_MAX_DELIVERIES"] = "3"
    services.start("scheduler")
    services.start("worker", "--concurrency", "2")
    services.start("triggerer")
    assert services.run("dags", "trigger", "e2e_forged_counts").returncode == 0
    queue = broker.keys.queue("default")

    def both_held() -> tuple[str, str] | None:
        if _states(sessions).get("running") != "running":
            return None
        trigger_entry = _only_pending(broker, broker.keys.triggers, GROUP_TRIGGERERS)
        queue_entry = _only_pending(broker, queue, GROUP_WORKERS)
        return (trigger_entry, queue_entry) if trigger_entry and queue_entry else None

    trigger_entry, queue_entry = wait_for(both_held, timeout=90, what="both entries held")
    _forge(broker, broker.keys.triggers, GROUP_TRIGGERERS, trigger_entry)
    _forge(broker, queue, GROUP_WORKERS, queue_entry)

    holders = ("triggerer", "worker")  # they take their entries back at their next renewal
    wait_for(
        lambda: all("not a registered consumer" in services.log(name) for name in holders),
        timeout=90,
        what="the triggerer and the worker to take the forged entries back",
    )
    assert _states(sessions) == {"deferred": "deferred", "running": "running"}
    fire_deferred(sessions, broker, cipher, "e2e_forged_counts", "deferred")
    gate.touch()
    wait_for(
        lambda: _states(sessions) == {"deferred": "success", "running": "success"},
        timeout=120,
        what="both tasks to succeed",
    )
    assert broker.xrange(broker.keys.dead) == []
    assert _changes(sessions, "running", "success") == {"deferred": 1, "running": 1}
    assert all(proc.poll() is None for proc in services.procs.values())


# -- entries of any shape -----------------------------------------------------------------------

WAIT_DAG = """
import datetime as dt

from deferral import DAG, BaseOperator
from deferral.triggers import TimeDeltaTrigger


class Waits(BaseOperator):
    def execute(self, context):
        self.defer(trigger=TimeDeltaTrigger(dt.timedelta(seconds=1)), method_name="resume")

    def resume(self, context, event):
        return "resumed"


with DAG("{dag_id}") as dag:
    Waits(task_id="wait")
"""

JUNK = 40_000  # small junk entries in all, spread over the three streams
DEAD_BOUND = 1_000


def _junk(broker: Broker, stream: str, n: int) -> None:
    with broker.redis.pipeline(transaction=False) as pipe:
        for i in range(n):
            pipe.execute_command("XADD", stream, "*", "junk", str(i))
            if i % 5_000 == 4_999:
                pipe.execute()
        pipe.execute()


def test_huge_wide_and_a_flood_of_junk_entries_are_dead_lettered_and_nothing_stops(
    services: Services, write_dag: Any, sessions: sessionmaker[Session], broker: Broker
) -> None:
    write_dag("e2e_before_junk", WAIT_DAG.format(dag_id="e2e_before_junk"))
    write_dag("e2e_after_junk", WAIT_DAG.format(dag_id="e2e_after_junk"))
    services.env["DEFERRAL_DEAD_LETTER_MAXLEN"] = str(DEAD_BOUND)
    queue = broker.keys.queue("default")
    streams = (broker.keys.triggers, broker.keys.events, queue)
    groups = {broker.keys.triggers: GROUP_TRIGGERERS, broker.keys.events: GROUP_SCHEDULERS}
    groups[queue] = GROUP_WORKERS
    procs: dict[str, ForkedProcess] = {
        "scheduler": services.start("scheduler"),
        "worker": services.start("worker", "--concurrency", "4"),
        "triggerer": services.start("triggerer"),
    }
    assert services.run("dags", "trigger", "e2e_before_junk").returncode == 0
    wait_for(lambda: _states(sessions) == {"wait": "success"}, timeout=90, what="a first task")

    for stream in streams:
        broker.redis.xadd(stream, {f"f{i}": "v" for i in range(4000)})
        broker.redis.xadd(stream, {"payload": b"x" * (10 * 1024 * 1024)})
    for stream in streams:
        _junk(broker, stream, JUNK // len(streams))
    assert services.run("dags", "trigger", "e2e_after_junk").returncode == 0

    def drained() -> bool:
        assert all(proc.poll() is None for proc in procs.values()), "a service stopped"
        # Bounded all along: MAXLEN ~ trims whole nodes of 100 entries.
        assert int(broker.redis.xlen(broker.keys.dead)) <= DEAD_BOUND + 100
        return all(int(broker.redis.xlen(s)) == 0 for s in streams)

    wait_for(drained, timeout=1200, interval=1, what="every junk entry to be dead-lettered")
    wait_for(
        lambda: (
            _dag_states(sessions) == {"e2e_before_junk": "success", "e2e_after_junk": "success"}
        ),
        timeout=120,
        what="the task deferred after the junk to resume and succeed",
    )
    assert DEAD_BOUND <= int(broker.redis.xlen(broker.keys.dead)) <= DEAD_BOUND + 100
    for name, over in (
        ("triggerer", "over the limit of 16 fields"),
        ("scheduler", "over the limit of 4194304 bytes"),
        ("worker", "over the limit of 16 fields"),
    ):
        assert over in services.log(name), name
