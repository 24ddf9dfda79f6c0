"""Deferrable sensors through the real processes: a deferral that times out is the sensor's
timeout (SensorTimeout, never retried; skipped with soft_fail), and a sensor already satisfied
returns from its first poke without ever deferring."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from deferral.store.tables import TaskInstance, TaskStateChange
from tests.e2e.conftest import Services
from tests.helpers import wait_for

pytestmark = pytest.mark.e2e

DAG = """
import datetime as dt

from deferral import DAG
from deferral.sensors import DateTimeSensorAsync, FileSensor

with DAG("e2e_sensors") as dag:
    FileSensor(task_id="times_out", filepath={missing!r}, deferrable=True, timeout=2,
               poke_interval=0.5, retries=2, retry_delay=dt.timedelta(0))
    FileSensor(task_id="soft_fails", filepath={missing!r}, deferrable=True, timeout=2,
               poke_interval=0.5, soft_fail=True, retries=2, retry_delay=dt.timedelta(0))
    FileSensor(task_id="file_present", filepath={present!r}, deferrable=True)
    DateTimeSensorAsync(task_id="moment_passed", target_time=dt.datetime(2000, 1, 1))
"""

FINISHED = {"success", "failed", "skipped"}


def _finished(sessions: sessionmaker[Session]) -> dict[str, TaskInstance] | None:
    with sessions() as session:
        tis = session.scalars(select(TaskInstance)).all()
    if len(tis) == 4 and all(ti.state in FINISHED for ti in tis):
        return {ti.task_id: ti for ti in tis}
    return None


def _changes(sessions: sessionmaker[Session], ti: TaskInstance) -> list[tuple[str, str, str]]:
    with sessions() as session:
        rows = session.execute(
            select(TaskStateChange.from_state, TaskStateChange.to_state, TaskStateChange.reason)
            .where(TaskStateChange.task_instance_id == ti.id)
            .order_by(TaskStateChange.id)
        ).all()
    return [(r.from_state, r.to_state, r.reason or "") for r in rows]


def test_deferrable_sensors_time_out_skip_and_return_at_once(
    services: Services, write_dag: Any, sessions: sessionmaker[Session], tmp_path: Path
) -> None:
    present = tmp_path / "landed" / "part-0001.csv"
    present.parent.mkdir()
    present.write_text("rows")
    write_dag(
        "e2e_sensors_dag",
        DAG.format(missing=str(tmp_path / "never" / "*.csv"), present=str(present.parent)),
    )
    services.start("scheduler")
    services.start("worker", "--concurrency", "2")
    services.start("triggerer")
    assert services.run("dags", "trigger", "e2e_sensors").returncode == 0

    tis = wait_for(lambda: _finished(sessions), timeout=90, what="every sensor to finish")

    # The deferral timed out: SensorTimeout, on the first try, although retries=2.
    timed_out = tis["times_out"]
    assert timed_out.state == "failed"
    assert timed_out.try_number == 1
    changes = _changes(sessions, timed_out)
    assert ("running", "deferred") in [(f, t) for f, t, _ in changes]
    assert changes[-1][1] == "failed"
    assert changes[-1][2].startswith("SensorTimeout: sensor 'times_out' timed out")
    assert "up_for_retry" not in [t for _, t, _ in changes]

    # soft_fail: the same timeout skips the task.
    soft = tis["soft_fails"]
    assert soft.state == "skipped"
    assert soft.try_number == 1
    assert "timed out" in _changes(sessions, soft)[-1][2]

    # Already satisfied: success from the first poke, never deferred.
    for task_id in ("file_present", "moment_passed"):
        ti = tis[task_id]
        assert ti.state == "success", task_id
        assert "deferred" not in [t for _, t, _ in _changes(sessions, ti)], task_id
        assert ti.trigger_id is None
