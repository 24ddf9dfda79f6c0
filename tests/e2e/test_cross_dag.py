"""Cross-DAG dependencies through the real processes, with DAGs written as Airflow's example
DAGs write them (example_trigger_controller_dag, example_external_task_marker_dag):
TriggerDagRunOperator (conf, run id and logical date templated, wait_for_completion in a worker
slot and deferred to a DagStateTrigger, failed_states, reset_dag_run, an existing run refused or
skipped), ExternalTaskSensor in poke, reschedule and deferrable modes (a task, a task group, the
run itself, execution_delta, skipped and failed states, check_existence), and ExternalTaskMarker
followed by a clear with downstream."""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable
from typing import Any

import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from deferral.store.tables import DagRun, TaskInstance, TaskStateChange, XCom
from tests.e2e.conftest import shared_stack_fixtures
from tests.helpers import wait_for

pytestmark = pytest.mark.e2e

stack, services, sessions, write_dag = shared_stack_fixtures(
    ("scheduler",), ("worker", "--concurrency", "4"), ("triggerer",)
)

FINISHED = {"success", "failed", "skipped", "upstream_failed"}
DAY = dt.datetime(2024, 3, 1, tzinfo=dt.UTC)

TRIGGER_DAGS = """
import datetime as dt

from deferral import DAG
from deferral.operators.python import PythonOperator
from deferral.operators.trigger_dagrun import TriggerDagRunOperator


def run_this_func(dag_run):
    print(f"Remotely received value of {dag_run.conf.get('message')} for key=message")
    return dag_run.conf.get("message")


def breaks():
    raise RuntimeError("the target breaks")


with DAG("xd_target", start_date=dt.datetime(2021, 1, 1), schedule=None):
    PythonOperator(task_id="run_this", python_callable=run_this_func)

with DAG("xd_failing_target", schedule=None):
    PythonOperator(task_id="breaks", python_callable=breaks)

with DAG("xd_controller", start_date=dt.datetime(2021, 1, 1), schedule=None):
    waits_in_slot = TriggerDagRunOperator(
        task_id="test_trigger_dagrun",
        trigger_dag_id="xd_target",
        conf={"message": "Hello from {{ run_id }}"},
        wait_for_completion=True,
        poke_interval=0.5,
    )
    deferred = TriggerDagRunOperator(
        task_id="deferred",
        trigger_dag_id="xd_target",
        trigger_run_id="child_of_{{ run_id }}",
        logical_date="2024-01-01T00:00:00+00:00",
        conf={"message": "deferred"},
        wait_for_completion=True,
        deferrable=True,
        poke_interval=0.5,
    )
    refused = TriggerDagRunOperator(
        task_id="already_exists", trigger_dag_id="xd_target", trigger_run_id="child_of_{{ run_id }}"
    )
    skipped = TriggerDagRunOperator(
        task_id="skip_when_already_exists",
        trigger_dag_id="xd_target",
        trigger_run_id="child_of_{{ run_id }}",
        skip_when_already_exists=True,
    )
    reset = TriggerDagRunOperator(
        task_id="reset_dag_run",
        trigger_dag_id="xd_target",
        trigger_run_id="child_of_{{ run_id }}",
        reset_dag_run=True,
        wait_for_completion=True,
        deferrable=True,
        poke_interval=0.5,
        trigger_rule="all_done",
    )
    waits_in_slot >> deferred >> [refused, skipped] >> reset
    TriggerDagRunOperator(
        task_id="target_fails",
        trigger_dag_id="xd_failing_target",
        wait_for_completion=True,
        deferrable=True,
        poke_interval=0.5,
    )
"""

SENSOR_DAGS = """
import datetime as dt

from deferral import DAG
from deferral.exceptions import SkipTask
from deferral.operators.empty import EmptyOperator
from deferral.operators.python import PythonOperator
from deferral.operators.trigger_dagrun import TriggerDagRunOperator
from deferral.sensors.external_task import ExternalTaskSensor
from deferral.utils.task_group import TaskGroup

DAY = "2024-03-01T00:00:00+00:00"


def skips():
    raise SkipTask("nothing to do today")


def breaks():
    raise RuntimeError("broken")


with DAG("xs_upstream", schedule=None):
    PythonOperator(task_id="done", python_callable=lambda: 1)
    PythonOperator(task_id="skipper", python_callable=skips)
    PythonOperator(task_id="broken", python_callable=breaks)
    with TaskGroup("grp"):
        EmptyOperator(task_id="a") >> EmptyOperator(task_id="b")

with DAG("xs_downstream", schedule=None, default_args={"poke_interval": 0.5, "timeout": 600}):
    ExternalTaskSensor(task_id="task_poke", external_dag_id="xs_upstream", external_task_id="done")
    ExternalTaskSensor(
        task_id="group_reschedule",
        external_dag_id="xs_upstream",
        external_task_group_id="grp",
        mode="reschedule",
    )
    ExternalTaskSensor(
        task_id="run_deferred",
        external_dag_id="xs_upstream",
        allowed_states=["success", "failed"],
        deferrable=True,
        poll_interval=0.5,
    )
    ExternalTaskSensor(
        task_id="skipped_upstream",
        external_dag_id="xs_upstream",
        external_task_id="skipper",
        skipped_states=["skipped"],
        deferrable=True,
        poll_interval=0.5,
    )
    ExternalTaskSensor(
        task_id="failed_upstream",
        external_dag_id="xs_upstream",
        external_task_ids=["done", "broken"],
        failed_states=["failed"],
        mode="reschedule",
    )
    ExternalTaskSensor(
        task_id="day_before",
        external_dag_id="xs_upstream",
        external_task_id="done",
        execution_delta=dt.timedelta(days=1),
    )
    ExternalTaskSensor(
        task_id="missing",
        external_dag_id="xs_upstream",
        external_task_id="no_such_task",
        check_existence=True,
    )

with DAG("xs_starter", schedule=None):
    TriggerDagRunOperator(task_id="down", trigger_dag_id="xs_downstream", logical_date=DAY) >> [
        TriggerDagRunOperator(task_id="up", trigger_dag_id="xs_upstream", logical_date=DAY),
        TriggerDagRunOperator(
            task_id="up_day_before",
            trigger_dag_id="xs_upstream",
            logical_date="{{ macros.ds_add('2024-03-01', -1) }}T00:00:00+00:00",
        ),
    ]
"""

MARKER_DAGS = """
import datetime as dt

from deferral import DAG
from deferral.operators.empty import EmptyOperator
from deferral.operators.trigger_dagrun import TriggerDagRunOperator
from deferral.sensors.external_task import ExternalTaskMarker, ExternalTaskSensor

DAY = "2024-03-01T00:00:00+00:00"

with DAG("xm_parent", start_date=dt.datetime(2021, 1, 1), schedule=None):
    ExternalTaskMarker(
        task_id="parent_task", external_dag_id="xm_child", external_task_id="child_task1"
    )

with DAG("xm_child", start_date=dt.datetime(2021, 1, 1), schedule=None):
    child_task1 = ExternalTaskSensor(
        task_id="child_task1",
        external_dag_id="xm_parent",
        external_task_id="parent_task",
        timeout=600,
        allowed_states=["success"],
        failed_states=["failed", "skipped"],
        mode="reschedule",
        poke_interval=0.5,
    )
    child_task2 = EmptyOperator(task_id="child_task2")
    child_task1 >> child_task2

with DAG("xm_starter", schedule=None):
    TriggerDagRunOperator(task_id="child", trigger_dag_id="xm_child", logical_date=DAY) >> (
        TriggerDagRunOperator(task_id="parent", trigger_dag_id="xm_parent", logical_date=DAY)
    )
"""


def _tis(sessions: sessionmaker[Session], *dag_ids: str) -> list[TaskInstance]:
    with sessions() as session:
        return list(
            session.scalars(select(TaskInstance).where(TaskInstance.dag_id.in_(dag_ids))).all()
        )


def _finished(
    sessions: sessionmaker[Session], dag_ids: tuple[str, ...], count: int
) -> dict[tuple[str, str, str], TaskInstance] | None:
    tis = _tis(sessions, *dag_ids)
    if len(tis) == count and all(ti.state in FINISHED for ti in tis):
        return {(ti.dag_id, ti.run_id, ti.task_id): ti for ti in tis}
    return None


def _tasks_when_finished(
    sessions: sessionmaker[Session], dag_id: str, count: int
) -> dict[str, TaskInstance]:
    """The ``count`` task instances of ``dag_id`` (one run), by task id, once all finished."""
    finished = wait_for(
        lambda: _finished(sessions, (dag_id,), count),
        timeout=300,
        what=f"the tasks of {dag_id} to finish",
    )
    return {ti.task_id: ti for ti in finished.values()}


def _runs(sessions: sessionmaker[Session], dag_id: str) -> list[DagRun]:
    with sessions() as session:
        return list(
            session.scalars(
                select(DagRun).where(DagRun.dag_id == dag_id).order_by(DagRun.logical_date)
            ).all()
        )


def _went_through(sessions: sessionmaker[Session], ti: TaskInstance, state: str) -> bool:
    with sessions() as session:
        states = session.scalars(
            select(TaskStateChange.to_state).where(TaskStateChange.task_instance_id == ti.id)
        ).all()
    return state in states


def _last_reason(sessions: sessionmaker[Session], ti: TaskInstance) -> str:
    with sessions() as session:
        reason = session.scalars(
            select(TaskStateChange.reason)
            .where(TaskStateChange.task_instance_id == ti.id)
            .order_by(TaskStateChange.id.desc())
        ).first()
    return reason or ""


def test_trigger_dag_run_operator(
    services: Any, sessions: sessionmaker[Session], write_dag: Callable[[str, str], Any]
) -> None:
    write_dag("xd_trigger_dags", TRIGGER_DAGS)
    assert services.run("dags", "trigger", "xd_controller", "--run-id", "c1").returncode == 0

    controller = _tasks_when_finished(sessions, "xd_controller", 6)
    target_runs = wait_for(
        lambda: (
            (runs := _runs(sessions, "xd_target"))
            and all(r.state in ("success", "failed") for r in runs)
            and runs
        ),
        timeout=120,
        what="the target's runs to end",
    )

    # Waiting in a slot: the target ran with the templated conf, and the task waited for it.
    assert controller["test_trigger_dagrun"].state == "success"
    by_conf = {run.conf.get("message"): run for run in target_runs}
    assert set(by_conf) == {"Hello from c1", "deferred"}
    assert by_conf["Hello from c1"].state == "success"
    assert by_conf["Hello from c1"].run_type == "manual"
    # Deferred: the run id and logical date as templated, the wait on a trigger, not a slot.
    child = by_conf["deferred"]
    assert child.run_id == "child_of_c1"
    assert child.logical_date == dt.datetime(2024, 1, 1, tzinfo=dt.UTC)
    assert controller["deferred"].state == "success"
    assert _went_through(sessions, controller["deferred"], "deferred")
    with sessions() as session:
        pushed = dict(
            session.execute(
                select(XCom.key, XCom.value).where(
                    XCom.task_instance_id == controller["deferred"].id
                )
            ).all()
        )
    assert pushed["trigger_run_id"] == "child_of_c1"
    # An existing run: refused by default, skipped when asked, cleared with reset_dag_run.
    assert controller["already_exists"].state == "failed"
    assert "DagRunAlreadyExists" in _last_reason(sessions, controller["already_exists"])
    assert controller["skip_when_already_exists"].state == "skipped"
    assert controller["reset_dag_run"].state == "success"
    child_ti = next(ti for ti in _tis(sessions, "xd_target") if ti.run_id == "child_of_c1")
    assert child_ti.state == "success" and child_ti.try_number == 2
    # A target that fails fails the waiting task.
    assert controller["target_fails"].state == "failed"
    assert "failed_states" in _last_reason(sessions, controller["target_fails"])
    assert [r.state for r in _runs(sessions, "xd_failing_target")] == ["failed"]


def test_external_task_sensor_in_every_mode(
    services: Any, sessions: sessionmaker[Session], write_dag: Callable[[str, str], Any]
) -> None:
    write_dag("xs_sensor_dags", SENSOR_DAGS)
    assert services.run("dags", "trigger", "xs_starter").returncode == 0

    down = _tasks_when_finished(sessions, "xs_downstream", 7)
    assert {task_id: ti.state for task_id, ti in down.items()} == {
        "task_poke": "success",
        "group_reschedule": "success",
        "run_deferred": "success",
        "skipped_upstream": "skipped",
        "failed_upstream": "failed",
        "day_before": "success",
        "missing": "failed",
    }
    assert _went_through(sessions, down["group_reschedule"], "up_for_reschedule")
    assert _went_through(sessions, down["run_deferred"], "deferred")
    assert "does not exist" in _last_reason(sessions, down["missing"])
    assert "failed state" in _last_reason(sessions, down["failed_upstream"])
    assert [run.logical_date for run in _runs(sessions, "xs_upstream")] == [
        DAY - dt.timedelta(days=1),
        DAY,
    ]


def test_external_task_marker_clears_the_dependent_dag(
    services: Any, sessions: sessionmaker[Session], write_dag: Callable[[str, str], Any]
) -> None:
    write_dag("xm_marker_dags", MARKER_DAGS)
    assert services.run("dags", "trigger", "xm_starter").returncode == 0
    wait_for(
        lambda: _finished(sessions, ("xm_parent", "xm_child"), 3),
        timeout=240,
        what="parent and child to finish",
    )
    parent_run = _runs(sessions, "xm_parent")[0]

    cleared = services.run(
        "tasks", "clear", "xm_parent", parent_run.run_id, "parent_task", "--downstream"
    )
    assert cleared.returncode == 0, cleared.stderr
    assert "xm_child:child_task1" in cleared.stdout
    assert "xm_child:child_task2" in cleared.stdout

    def tries() -> dict[str, int] | None:
        done = _finished(sessions, ("xm_parent", "xm_child"), 3)
        if done is None:
            return None
        found = {task_id: ti.try_number for (_, _, task_id), ti in done.items()}
        return found if set(found.values()) == {2} else None

    assert wait_for(tries, timeout=240, what="parent and child to run again") == {
        "parent_task": 2,
        "child_task1": 2,
        "child_task2": 2,
    }
