"""A worker's attempt writes its output to the try's log: in order, with the worker's lines
around it, secrets masked, complete when the outcome is recorded."""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable
from pathlib import Path

import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from broker.client import Broker
from broker.streams import queue_message
from deferral.store import tasklogs, transitions
from deferral.store.tables import DagRun, TaskInstance
from deferral.store.transitions import NewTaskInstance
from tests.helpers import wait_for
from worker.service import WorkerService

DAG_SOURCE = """
import logging
import subprocess

from deferral import DAG, BaseOperator
from deferral.hooks.base import BaseHook


class Noisy(BaseOperator):
    def execute(self, context):
        password = BaseHook.get_connection("warehouse").password
        print(f"connecting with {password}")
        logging.getLogger("noisy").info("logged after the print")
        subprocess.run(["echo", "a subprocess said so"], check=True)
        raise ValueError(f"could not log in with {password}")


with DAG("output_dag") as dag:
    Noisy(task_id="noisy")
"""


def _queued(sessions: sessionmaker[Session]) -> int:
    with sessions.begin() as session:
        transitions.create_dag_run(session, "output_dag", "r1", dt.datetime.now(dt.UTC), {})
        run = session.scalars(select(DagRun)).one()
        transitions.start_dag_run(
            session, run, [NewTaskInstance("noisy", 0, "default_pool", 1, "default", 1)]
        )
        ti = session.scalars(select(TaskInstance)).one()
        transitions.schedule(session, [ti.id])
        transitions.dispatch(session, [ti.id])
        return ti.id


@pytest.fixture
def warehouse_connection(monkeypatch: pytest.MonkeyPatch) -> None:
    """Set before the worker starts: its task processes have the environment it started with."""
    monkeypatch.setenv("DEFERRAL_CONN_WAREHOUSE", "postgresql://loader:Tr0ub4dor-3@db:5432/dw")


def test_what_an_attempt_writes_is_in_its_log_in_order_with_secrets_masked(
    warehouse_connection: None,
    worker: WorkerService,
    sessions: sessionmaker[Session],
    broker: Broker,
    write_dag: Callable[[str, str], Path],
) -> None:
    write_dag("output_dag", DAG_SOURCE)
    ti_id = _queued(sessions)
    broker.publish(
        worker.streams[0], queue_message(worker.cipher, ti_id, 1, "output_dag", "r1", "noisy", -1)
    )

    def ended() -> bool:
        worker.step()
        with sessions() as session:
            return session.get(TaskInstance, ti_id).state == "failed"  # type: ignore[union-attr]

    wait_for(ended, timeout=60, what="the attempt to fail")

    with sessions() as session:
        lines = tasklogs.read_lines(session, ti_id, 1)
    shown = [(line.source, line.text.splitlines()[0]) for line in lines]
    assert shown == [
        ("worker", f"try 1 started on worker survivor ({worker.hostname})"),
        ("task", "INFO deferral.hooks.base: Using connection ID 'warehouse' for task execution."),
        ("task", "connecting with ***"),
        ("task", "INFO noisy: logged after the print"),
        ("task", "a subprocess said so"),
        ("worker", "failed, now failed: ValueError: could not log in with ***"),
    ]
    assert "Traceback" in lines[-1].text and "Tr0ub4dor-3" not in lines[-1].text
