"""No DAG file can stop or shadow a service (issues 31 and 32): one whose import never
finishes costs the scheduler an import error after DEFERRAL_DAGBAG_IMPORT_TIMEOUT (its heartbeat
stays fresh, other DAGs run, SIGTERM stops it at once), and DAG files named like our packages
or the standard library's json load and run under every service."""

from __future__ import annotations

import datetime as dt
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

from deferral.store import transitions
from deferral.store.tables import Dag, DagImportError, DagRun, Scheduler
from tests.e2e.conftest import Services
from tests.helpers import wait_for

pytestmark = pytest.mark.e2e

TIMEOUT_SEC = 2
SLEEPS_FOR_EVER = "import time\nwhile True:\n    time.sleep(1)\n"
# Each named like a package of ours, the standard library's json, or deferral itself; one task
# through the worker, and for one of them a deferral through the triggerer.
NAMED = """
import datetime as dt
from deferral import DAG, BaseOperator
from deferral.operators import PythonOperator
from deferral.triggers import TimeDeltaTrigger


class DeferOnce(BaseOperator):
    def execute(self, context):
        self.defer(trigger=TimeDeltaTrigger(dt.timedelta(seconds=0)), method_name="resume")

    def resume(self, context, event):
        return "resumed"


def report():
    import json
    return json.dumps({{"from": "{dag_id}"}})


with DAG("{dag_id}") as dag:
    PythonOperator(task_id="report", python_callable=report) >> DeferOnce(task_id="defer")
"""
# Read after json.py: it must find the real json.
USES_JSON = "import json\nassert hasattr(json, 'dumps'), json\n" + NAMED
HOSTILE_NAMES = ("deferral", "broker", "worker", "scheduler", "triggerer", "webserver", "json")


def _recorded(sessions: sessionmaker[Session]) -> set[str]:
    with sessions() as session:
        return set(session.scalars(select(Dag.dag_id).where(Dag.is_active)))


def _heartbeat_age(sessions: sessionmaker[Session]) -> float:
    with sessions() as session:
        age = session.scalar(
            select(func.extract("epoch", func.now() - func.max(Scheduler.latest_heartbeat)))
        )
    return float(age) if age is not None else 0.0


def test_no_dag_file_stops_or_shadows_a_service(
    services: Services, dags_folder: Path, sessions: sessionmaker[Session]
) -> None:
    dag_ids = [f"named_{name}" for name in HOSTILE_NAMES] + ["uses_json"]
    for name in HOSTILE_NAMES:
        (dags_folder / f"{name}.py").write_text(NAMED.format(dag_id=f"named_{name}"))
    (dags_folder / "zz_uses_json.py").write_text(USES_JSON.format(dag_id="uses_json"))
    services.env["DEFERRAL_DAGBAG_IMPORT_TIMEOUT"] = str(TIMEOUT_SEC)
    services.env["DEFERRAL_DAG_REFRESH_SEC"] = "1"
    scheduler = services.start("scheduler")
    services.start("worker")
    services.start("triggerer")
    wait_for(lambda: _recorded(sessions) == set(dag_ids), timeout=120, what="the DAGs recorded")

    # A file whose import never finishes comes while the scheduler runs (sorted first, before
    # every other file of the folder).
    sleeper = dags_folder / "a_sleeps_for_ever.py"
    sleeper.write_text(SLEEPS_FOR_EVER)
    with sessions.begin() as session:
        for dag_id in dag_ids:
            transitions.create_dag_run(session, dag_id, "r1", dt.datetime.now(dt.UTC), {})
    ages: list[float] = []

    def all_done() -> Any:
        ages.append(_heartbeat_age(sessions))
        with sessions() as session:
            states = dict(session.execute(select(DagRun.dag_id, DagRun.state)).all())
            errors = dict(
                session.execute(select(DagImportError.filename, DagImportError.error)).all()
            )
        finished = all(states.get(dag_id) in ("success", "failed") for dag_id in dag_ids)
        return finished and errors and (states, errors)

    states, errors = wait_for(all_done, timeout=120, interval=0.2, what="every run to finish")
    assert states == dict.fromkeys(dag_ids, "success")
    assert errors == {
        str(sleeper.resolve()): f"DagImportTimeout: importing the file took longer than "
        f"{TIMEOUT_SEC} s (DEFERRAL_DAGBAG_IMPORT_TIMEOUT) (line 3)"
    }
    # Scheduling went on while the file was imported: the heartbeat kept its period.
    assert max(ages) < 2.0, ages

    # Changed, the file is imported again; a SIGTERM meanwhile stops the scheduler at once.
    os.utime(sleeper)
    children = wait_for(lambda: _children_of(scheduler.pid), timeout=30, what="a parse child")
    began = time.monotonic()
    scheduler.send_signal(signal.SIGTERM)
    assert scheduler.wait(timeout=30) == 0
    assert time.monotonic() - began < 5
    wait_for(lambda: not any(map(_running, children)), timeout=10, what="the parse child to end")


def _children_of(pid: int) -> list[int]:
    """The processes ``pid`` forked (a scheduler's: its parse child)."""
    children: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            children += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            continue
    return children


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"
