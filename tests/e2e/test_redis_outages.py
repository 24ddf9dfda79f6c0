"""The services on a Redis of their own (AOF with ``appendfsync everysec``, ``noeviction``)
that goes away and comes back while tasks are deferred: kill -9, seconds down, then a restart
from its AOF; the same with its data lost; and ``maxmemory`` reached (every write refused) then
freed. In each, every task succeeds exactly once (one change to success in task_state_change,
one line in its own side-effect file), no service dies, work resumes within a deadline of the
server's return, and each service says what is wrong in one line (not one per retry) while
``deferral_redis_unavailable`` is 1, and one line when it is over.

One stack for the module (the services are never stopped; Redis is), each case a DAG of its own.
"""

from __future__ import annotations

import datetime as dt
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

from deferral.store.tables import TaskInstance, TaskStateChange
from deferral_cli.embedded import free_port
from tests.e2e.conftest import Services, shared_stack_fixtures
from tests.e2e.test_metrics import scrape, value
from tests.helpers import wait_for
from tests.redis_topologies import LocalRedis, redis_binaries_found, running

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(not redis_binaries_found(), reason="redis-server/redis-cli not found"),
]

N = 20
# Longer than the services' settling (two heartbeats of the stack's 1 s): each loop fails a few
# times and the outage is not over before the server returns.
OUTAGE_SEC = 3.0
# From the server's return to the first resume, on a loaded 2-core machine (the benchmark,
# benchmarks/redis_faults.py, measures it).
RESUME_WITHIN_SEC = 30.0
# What every service logs once when Redis fails (then at most once a minute), and at its end.
UNAVAILABLE, AGAIN = "servers unavailable", "servers available again"

# Each task waits on the case's gate and, resumed, appends a line to a file of its own: a task
# that ran twice shows two.
DAG = """
import os

from deferral import DAG, BaseOperator
from deferral.triggers import FileTrigger

GATE, OUT = {gate!r}, {out!r}


class Wait(BaseOperator):
    def execute(self, context):
        self.defer(trigger=FileTrigger(GATE, poll_interval=0.5), method_name="resume")

    def resume(self, context, event):
        with open(os.path.join(OUT, self.task_id), "a") as out:
            out.write("ran\\n")


with DAG({dag_id!r}, max_active_tasks={n}) as dag:
    for i in range({n}):
        Wait(task_id=f"t{{i}}")
"""

METRICS_PORT = free_port()
stack, services, sessions, write_dag = shared_stack_fixtures(
    ("scheduler",),
    ("worker", "--concurrency", "4", "--metrics-port", str(METRICS_PORT)),
    ("triggerer",),
)


@pytest.fixture(scope="module")
def local_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalRedis]:
    yield from running(LocalRedis(tmp_path_factory.mktemp("redis")))


@pytest.fixture(scope="module")
def redis_url(local_redis: LocalRedis) -> str:
    return local_redis.url


def _states(sessions: sessionmaker[Session], dag_id: str) -> dict[str, int]:
    with sessions() as session:
        return dict(
            session.execute(
                select(TaskInstance.state, func.count())
                .where(TaskInstance.dag_id == dag_id)
                .group_by(TaskInstance.state)
            ).all()
        )


def _changes(
    sessions: sessionmaker[Session], dag_id: str, to_state: str, from_state: str | None = None
) -> list[Any]:
    """(task_id, at) of each change of ``dag_id``'s tasks to ``to_state`` (from
    ``from_state``)."""
    query = (
        select(TaskInstance.task_id, TaskStateChange.at)
        .join(TaskStateChange, TaskStateChange.task_instance_id == TaskInstance.id)
        .where(TaskInstance.dag_id == dag_id, TaskStateChange.to_state == to_state)
    )
    if from_state is not None:
        query = query.where(TaskStateChange.from_state == from_state)
    with sessions() as session:
        return list(session.execute(query).all())


def _lines(services: Services, said: str) -> dict[str, int]:
    return {name: services.log(name).count(said) for name in services.procs}


def _outage(
    services: Services,
    sessions: sessionmaker[Session],
    write_dag: Callable[[str, str], Path],
    tmp_path: Path,
    dag_id: str,
    *,
    away: Callable[[Path], None],
    back: Callable[[], None],
) -> None:
    """``N`` tasks of ``dag_id`` deferred; Redis goes ``away`` (given the gate), the gate opens
    (the triggers fire meanwhile), ``OUTAGE_SEC`` later it comes ``back``: every task must
    succeed once, none before the return, the first within ``RESUME_WITHIN_SEC`` of it."""
    gate, out = tmp_path / "gate", tmp_path / "out"
    out.mkdir()
    write_dag(dag_id, DAG.format(dag_id=dag_id, gate=str(gate), out=str(out), n=N))
    assert services.run("dags", "trigger", dag_id).returncode == 0
    wait_for(lambda: _states(sessions, dag_id) == {"deferred": N}, timeout=180, what="deferrals")
    said_before = _lines(services, UNAVAILABLE)

    away(gate)
    try:
        gate.write_text("open")
        time.sleep(OUTAGE_SEC)  # the outage itself: what is tested is what the services do in it
        succeeded = _changes(sessions, dag_id, "success")
    finally:
        back()  # the module's next case needs its Redis whatever failed here
    returned = dt.datetime.now(dt.UTC)
    assert not succeeded, "tasks succeeded while Redis was away"

    wait_for(lambda: _states(sessions, dag_id) == {"success": N}, timeout=300, what="successes")
    first_success = min(at for _, at in _changes(sessions, dag_id, "success"))
    assert (first_success - returned).total_seconds() < RESUME_WITHIN_SEC
    successes = sorted(task_id for task_id, _ in _changes(sessions, dag_id, "success"))
    assert successes == sorted(f"t{i}" for i in range(N))
    assert {p.name: p.read_text() for p in out.iterdir()} == {f"t{i}": "ran\n" for i in range(N)}
    assert {name: proc.poll() for name, proc in services.procs.items()} == {
        name: None for name in services.procs
    }
    # One line per service for an outage shorter than a minute, and one for its end (once no
    # call failed for two heartbeats, outages.settle_over_heartbeats): the next case's outage is
    # said again.
    said = _lines(services, UNAVAILABLE)
    assert all(said[name] - said_before[name] <= 1 for name in said), said
    assert any(said[name] > said_before[name] for name in said), said
    wait_for(lambda: _lines(services, AGAIN) == said, timeout=60, what=f"{AGAIN!r} {said}")


@pytest.mark.parametrize("data", [True, False], ids=["from_its_aof", "without_its_data"])
def test_kill_9_seconds_down_then_a_restart(
    stack: Any,
    services: Services,
    sessions: sessionmaker[Session],
    write_dag: Any,
    local_redis: LocalRedis,
    tmp_path: Path,
    data: bool,
) -> None:

    def away(gate: Path) -> None:
        if data:  # the deferrals' entries are in the file it restarts from
            local_redis.written()
        local_redis.down()

    _outage(
        services,
        sessions,
        write_dag,
        tmp_path,
        f"e2e_outage_{'aof' if data else 'lost'}",
        away=away,
        back=lambda: local_redis.up(data=data),
    )


def test_maxmemory_reached_then_freed(
    stack: Any,
    services: Services,
    sessions: sessionmaker[Session],
    write_dag: Any,
    local_redis: LocalRedis,
    tmp_path: Path,
) -> None:
    worker = services.procs["worker"]
    queue = stack.broker.keys.queue("default")

    def full(gate: Path) -> None:
        # The tasks resumed and their attempts queued while the worker is stopped: it reads them
        # once Redis is full (reads are allowed), and cannot mark them started (writes are not).
        worker.send_signal(signal.SIGSTOP)
        try:
            gate.write_text("open")
            wait_for(lambda: stack.broker.redis.xlen(queue) >= N, timeout=120, what="queued")
            local_redis.full()
        finally:
            worker.send_signal(signal.SIGCONT)

    def freed() -> None:
        # The worker read the attempts and its writes are refused: it says so.
        wait_for(
            lambda: value(scrape(METRICS_PORT), "deferral_redis_unavailable") == 1,
            timeout=60,
            what="the worker to show Redis unavailable",
        )
        local_redis.full(refuse=False)

    _outage(services, sessions, write_dag, tmp_path, "e2e_outage_full", away=full, back=freed)
    wait_for(
        lambda: value(scrape(METRICS_PORT), "deferral_redis_unavailable") == 0,
        timeout=60,
        what="the worker to show Redis available again",
    )
    assert "OutOfMemoryError" in services.log("worker")
