"""A sensor in reschedule mode frees its worker slot between pokes, through the real processes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from deferral.store.tables import TaskInstance, TaskReschedule, TaskStateChange
from tests.e2e.conftest import Services
from tests.helpers import wait_for

pytestmark = pytest.mark.e2e

DAG = """
from deferral import DAG
from deferral.operators import PythonOperator
from deferral.sensors import FileSensor

with DAG("e2e_reschedule") as dag:
    FileSensor(task_id="sense", filepath={path!r}, mode="reschedule", poke_interval=0.3,
               priority_weight=10)
    PythonOperator(task_id="other", python_callable=lambda: "ran in between")
"""


def _ti(sessions: sessionmaker[Session], task_id: str) -> TaskInstance | None:
    with sessions() as session:
        return session.scalars(select(TaskInstance).where(TaskInstance.task_id == task_id)).first()


def test_reschedule_mode_sensor_pokes_again_later_on_the_same_try(
    services: Services, write_dag: Any, sessions: sessionmaker[Session], tmp_path: Path
) -> None:
    flag = tmp_path / "ready.flag"
    write_dag("e2e_reschedule_dag", DAG.format(path=str(flag)))
    services.start("scheduler")
    services.start("worker", "--concurrency", "1")
    assert services.run("dags", "trigger", "e2e_reschedule").returncode == 0

    def rescheduled_twice() -> bool:
        with sessions() as session:
            return len(session.scalars(select(TaskReschedule)).all()) >= 2

    wait_for(rescheduled_twice, timeout=60, what="two reschedules")
    # The single slot was free between pokes: the other task ran meanwhile.
    other = wait_for(
        lambda: (ti := _ti(sessions, "other")) and ti.state == "success" and ti,
        timeout=30,
        what="the other task",
    )
    assert other is not None
    flag.write_text("go")
    sense = wait_for(
        lambda: (ti := _ti(sessions, "sense")) and ti.state == "success" and ti,
        timeout=30,
        what="the sensor to succeed",
    )
    assert sense.try_number == 1
    with sessions() as session:
        changes = session.execute(
            select(TaskStateChange.from_state, TaskStateChange.to_state)
            .where(TaskStateChange.task_instance_id == sense.id)
            .order_by(TaskStateChange.id)
        ).all()
        tries = set(session.scalars(select(TaskReschedule.try_number)))
    pairs = [tuple(c) for c in changes]
    assert ("running", "up_for_reschedule") in pairs
    assert ("up_for_reschedule", "scheduled") in pairs
    assert pairs[-1] == ("running", "success")
    assert tries == {1}
