"""Queues for triggerers and workers through real processes (issue 17): a trigger inherits its
task's queue and runs only on a triggerer serving it, one worker serves several queues, doctor
and tasks explain name a trigger no live triggerer serves, and two triggerers share a burst of
1,000 triggers. One stack serves the module; the last test stops the gpu triggerer."""

from __future__ import annotations

import datetime as dt
import signal
from typing import Any

import pytest
from sqlalchemy import select, text
from sqlalchemy.orm import Session, sessionmaker

from broker.streams import GROUP_TRIGGERERS, to_fields
from deferral.runtime.crypto import Cipher
from deferral.store.tables import DagRun, TaskInstance, Trigger, Triggerer
from deferral.triggers import DateTimeTrigger
from deferral.triggers.base import classpath_of
from tests.e2e.conftest import Services, Stack, fire_deferred, shared_stack_fixtures
from tests.helpers import wait_for
from tests.integration.factories import timer_message

pytestmark = pytest.mark.e2e

stack, services, sessions, write_dag = shared_stack_fixtures(
    ("scheduler",),
    ("worker1", "--concurrency", "1", "--queues", "a,b"),
    ("worker2", "--concurrency", "1", "--queue", "default,gpu"),  # the old spelling, a list
    ("triggerer1", "--queues", "gpu", "--name", "tgpu"),
    ("triggerer2", "--queues", "default", "--name", "tdefault"),
)

GPU_DAG = """
import datetime as dt

from deferral import DAG, BaseOperator
from deferral.triggers import TimeDeltaTrigger


class Wait(BaseOperator):
    def execute(self, context):
        self.defer(trigger=TimeDeltaTrigger(dt.timedelta(hours=1)), method_name="resume")

    def resume(self, context, event):
        return "resumed"


with DAG("e2e_queue_gpu") as dag:
    Wait(task_id="wait", queue="gpu")
"""

AB_DAG = """
from deferral import DAG
from deferral.operators.python import PythonOperator

with DAG("e2e_queues_ab") as dag:
    PythonOperator(task_id="in_a", queue="a", python_callable=lambda: "a")
    PythonOperator(task_id="in_b", queue="b", python_callable=lambda: "b")
"""


def _states(sessions: sessionmaker[Session], dag_id: str, run_id: str | None = None) -> Any:
    with sessions() as session:
        query = select(TaskInstance.task_id, TaskInstance.state).where(
            TaskInstance.dag_id == dag_id
        )
        if run_id is not None:
            query = query.where(TaskInstance.run_id == run_id)
        return {row.task_id: row.state for row in session.execute(query)}


def _trigger(sessions: sessionmaker[Session], dag_id: str, run_id: str) -> Trigger | None:
    with sessions() as session:
        trigger_id = session.scalars(
            select(TaskInstance.trigger_id).where(
                TaskInstance.dag_id == dag_id,
                TaskInstance.run_id == run_id,
                TaskInstance.state == "deferred",
            )
        ).first()
        return None if trigger_id is None else session.get(Trigger, trigger_id)


def _trigger_run(services: Services, sessions: sessionmaker[Session], dag_id: str) -> str:
    """Trigger a run of ``dag_id``; its run id."""
    with sessions() as session:
        before = set(session.scalars(select(DagRun.run_id).where(DagRun.dag_id == dag_id)))
    done = services.run("dags", "trigger", dag_id)
    assert done.returncode == 0, done.stdout + done.stderr
    with sessions() as session:
        after = set(session.scalars(select(DagRun.run_id).where(DagRun.dag_id == dag_id)))
    (run_id,) = after - before
    return run_id


def test_a_gpu_task_defers_and_its_trigger_runs_only_on_the_gpu_triggerer(
    services: Services, write_dag: Any, sessions: sessionmaker[Session], stack: Stack
) -> None:
    write_dag("e2e_queue_gpu", GPU_DAG)
    run_id = _trigger_run(services, sessions, "e2e_queue_gpu")
    wait_for(
        lambda: (
            (t := _trigger(sessions, "e2e_queue_gpu", run_id)) is not None
            and t.triggerer_id is not None
        ),
        timeout=150,
        what="the gpu trigger to be picked up",
    )
    trigger = _trigger(sessions, "e2e_queue_gpu", run_id)
    assert trigger is not None and trigger.triggerer_id == "tgpu"
    keys = stack.broker.keys
    gpu = stack.broker.pending(keys.triggers_for("gpu"), GROUP_TRIGGERERS)
    assert gpu.per_consumer == {"tgpu": 1}
    assert keys.triggers_for("gpu") == f"{keys.triggers}:gpu"
    fire_deferred(sessions, stack.broker, Cipher(_fernet(services)), "e2e_queue_gpu", "wait")
    wait_for(
        lambda: _states(sessions, "e2e_queue_gpu", run_id) == {"wait": "success"},
        timeout=150,
        what="the gpu task to resume and succeed",
    )
    assert "e2e_queue_gpu" not in services.log("triggerer2")


def test_one_worker_with_two_queues_runs_the_tasks_of_both(
    services: Services, write_dag: Any, sessions: sessionmaker[Session]
) -> None:
    write_dag("e2e_queues_ab", AB_DAG)
    _trigger_run(services, sessions, "e2e_queues_ab")
    wait_for(
        lambda: _states(sessions, "e2e_queues_ab") == {"in_a": "success", "in_b": "success"},
        timeout=150,
        what="the tasks of queues a and b to succeed",
    )
    with sessions() as session:
        hosts = set(
            session.scalars(
                select(TaskInstance.worker).where(TaskInstance.dag_id == "e2e_queues_ab")
            )
        )
    assert len(hosts) == 1 and hosts != {None}


def test_two_triggerers_started_together_share_1000_triggers(
    services: Services, sessions: sessionmaker[Session], stack: Stack
) -> None:
    services.start("triggerer3", "--queues", "even", "--name", "teven1")
    services.start("triggerer4", "--queues", "even", "--name", "teven2")
    for name in ("triggerer3", "triggerer4"):
        services.wait_up(name)
        # Each knows it has peers (a triggerer alone would read at full speed).
        wait_for(lambda n=name: "live peer" in services.log(n), timeout=60, what="peers seen")
    stream = _seed_triggers(sessions, stack, _fernet(services), 1000, "even")

    def held() -> dict[str, int]:
        return stack.broker.pending(stream, GROUP_TRIGGERERS).per_consumer

    wait_for(lambda: sum(held().values()) == 1000, timeout=120, what="1,000 triggers held")
    split = held()
    assert set(split) == {"teven1", "teven2"}
    assert all(400 <= n <= 600 for n in split.values()), split
    print(f"1,000 triggers held as {split}")
    for name in ("triggerer3", "triggerer4"):
        services.procs[name].send_signal(signal.SIGTERM)
        services.procs[name].wait(timeout=60)


def test_doctor_and_explain_name_a_trigger_no_live_triggerer_serves(
    services: Services, sessions: sessionmaker[Session]
) -> None:
    services.procs["triggerer1"].send_signal(signal.SIGTERM)
    services.procs["triggerer1"].wait(timeout=60)
    with sessions() as session:
        assert session.get(Triggerer, "tgpu").state == "stopped"  # type: ignore[union-attr]
    run_id = _trigger_run(services, sessions, "e2e_queue_gpu")
    wait_for(
        lambda: _trigger(sessions, "e2e_queue_gpu", run_id) is not None,
        timeout=150,
        what="the gpu task to defer",
    )
    trigger = _trigger(sessions, "e2e_queue_gpu", run_id)
    assert trigger is not None
    doctor = services.run("doctor").stdout
    assert "fail  trigger queues served: no live triggerer serves" in doctor, doctor
    assert f"queue 'gpu': trigger {trigger.id} (e2e_queue_gpu.{run_id}.wait)" in doctor, doctor
    explained = services.run("tasks", "explain", "e2e_queue_gpu", run_id, "wait").stdout
    assert "no live triggerer serves its queue 'gpu'" in explained, explained


def _fernet(services: Services) -> list[str]:
    return services.env["DEFERRAL_FERNET_KEY"].split(",")


def _seed_triggers(
    sessions: sessionmaker[Session], stack: Stack, keys: list[str], n: int, queue: str
) -> str:
    """``n`` tasks of ``queue`` deferred on an hour-long DateTimeTrigger each, with their rows
    written in three statements and their entries published in one round trip, as if workers
    had deferred them at once; the triggers stream they are in."""
    cipher = Cipher(keys)
    with sessions.begin() as session:
        session.execute(
            text(
                "INSERT INTO dag_run (dag_id, run_id, logical_date, state, start_date)"
                " VALUES ('e2e_even', 'seeded', now(), 'running', now())"
            )
        )
        rows = session.execute(
            text(
                "WITH t AS (INSERT INTO trigger (classpath, kwargs)"
                " SELECT :classpath, '' FROM generate_series(1, :n) RETURNING id)"
                " INSERT INTO task_instance (dag_id, run_id, task_id, state, try_number, queue,"
                " trigger_id, next_method, start_date, first_started_at)"
                " SELECT 'e2e_even', 'seeded', 't' || t.id, 'deferred', 1, :queue, t.id,"
                " 'resume', now(), now() FROM t RETURNING id, trigger_id"
            ),
            {"classpath": classpath_of(DateTimeTrigger), "n": n, "queue": queue},
        ).all()
    moment = dt.datetime.now(dt.UTC) + dt.timedelta(hours=1)
    stream = stack.broker.keys.triggers_for(queue)
    entries = [
        (
            stream,
            to_fields(
                timer_message(cipher, trigger_id, moment, ti_id, f"e2e_even.seeded.t{trigger_id}")
            ),
        )
        for ti_id, trigger_id in rows
    ]
    stack.broker.publish_many(entries)
    return stream
