"""Dynamic task mapping through the real scheduler, worker and triggerer processes: the
acceptance DAG of issue 6 (a mapped @task over an upstream list, a deferrable sensor in a task
group, a branch and a short circuit), a mapped classic operator over a literal list, a mapped
deferrable operator whose map indexes each defer on their own trigger, expand_kwargs, an empty
expansion, and reduces that pull the mapped values. One set of processes serves the module, each
test its own DAG."""

from __future__ import annotations

import subprocess
from typing import Any

import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from deferral.runtime.crypto import Cipher
from deferral.store.tables import DagRun, TaskInstance, TaskStateChange
from deferral.store.xcom import DatabaseXComs
from tests.e2e.conftest import Services, Stack, command, fire_deferred, shared_stack_fixtures
from tests.helpers import wait_for

pytestmark = pytest.mark.e2e


stack, services, sessions, write_dag = shared_stack_fixtures(
    ("scheduler",), ("worker", "--concurrency", "2"), ("triggerer",)
)


ACCEPTANCE_DAG = """
import datetime as dt

from deferral import TaskGroup, dag, task
from deferral.operators import EmptyOperator
from deferral.sensors import TimeDeltaSensor


@task
def orders():
    return [3, 5, 8]


@task
def price(amount, rate):
    return amount * rate


@task
def total(prices):
    return sum(prices)


@task.branch
def route(amount):
    return "big" if amount > 10 else "small"


@task.short_circuit
def worth_reporting(amount):
    return amount > 1000


@dag(schedule=None)
def e2e_mapping_acceptance():
    amount = total(price.partial(rate=2).expand(amount=orders()))
    with TaskGroup("wait") as wait:
        TimeDeltaSensor(
            task_id="pause", delta=dt.timedelta(hours=1), deferrable=True, poke_interval=1
        ) >> EmptyOperator(task_id="after_pause")
    big, small = EmptyOperator(task_id="big"), EmptyOperator(task_id="small")
    join = EmptyOperator(task_id="join", trigger_rule="none_failed_min_one_success")
    route(amount) >> [big, small] >> join
    worth_reporting(amount) >> EmptyOperator(task_id="report")
    [join, wait] >> EmptyOperator(task_id="done")


e2e_mapping_acceptance()
"""

CLASSIC_DAG = """
from deferral import DAG, task
from deferral.operators import BashOperator, PythonOperator


def reduce_lines(ti):
    return ti.xcom_pull(task_ids="echo")


@task
def make_pairs():
    return [{"x": 1, "y": 2}, {"x": 3, "y": 4}]


@task
def add(x, y):
    return x + y


@task
def collect(sums):
    return list(sums)


with DAG("e2e_mapping_classic"):
    echo = BashOperator.partial(task_id="echo", env={"WHO": "map"}).expand(
        bash_command=["echo $WHO {{ ti.map_index }} a", "echo $WHO {{ ti.map_index }} b"]
    )
    echo >> PythonOperator(task_id="reduce", python_callable=reduce_lines)
    collect(add.expand_kwargs(make_pairs()))
    BashOperator.partial(task_id="kw", env={"A": "literal"}).expand_kwargs(
        [{"bash_command": "echo $A"}, {"bash_command": "echo one", "cwd": "/"}]
    )
"""

DEFERRABLE_DAG = """
import datetime as dt

from deferral import DAG, BaseOperator
from deferral.operators import PythonOperator
from deferral.triggers import TimeDeltaTrigger


class WaitSeconds(BaseOperator):
    def __init__(self, *, seconds, **kwargs):
        super().__init__(**kwargs)
        self.seconds = seconds

    def execute(self, context):
        self.defer(
            trigger=TimeDeltaTrigger(dt.timedelta(seconds=self.seconds)),
            method_name="done",
            kwargs={"index": context["ti"].map_index},
        )

    def done(self, context, event, index):
        return f"{index} waited {self.seconds}s"


def reduce_waits(ti):
    return ti.xcom_pull(task_ids="wait")


with DAG("e2e_mapping_deferrable"):
    wait = WaitSeconds.partial(task_id="wait").expand(seconds=[3, 4, 5])
    wait >> PythonOperator(task_id="reduce", python_callable=reduce_waits)
"""

EMPTY_DAG = """
from deferral import DAG, task
from deferral.operators import EmptyOperator


@task
def nothing():
    return []


@task
def handle(item):
    return item


with DAG("e2e_mapping_empty"):
    handled = handle.expand(item=nothing())
    handled >> EmptyOperator(task_id="after")
    handled >> EmptyOperator(task_id="cleanup", trigger_rule="all_done")
"""


def _run(
    services: Services, sessions: sessionmaker[Session], dag_id: str, then: Any = None
) -> None:
    """Trigger ``dag_id`` and wait for its run to succeed; ``then()``, if given, is called while
    it runs."""
    services.parsed(dag_id)  # what `dags trigger` reads
    waiting = subprocess.Popen(
        command("deferral", "dags", "trigger", dag_id, "--wait", "--timeout", "150"),
        env=services.env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        if then is not None:
            then()
        out, _ = waiting.communicate(timeout=180)
    finally:
        if waiting.poll() is None:
            waiting.kill()
    assert waiting.returncode == 0, out
    with sessions() as session:
        state = session.scalars(select(DagRun.state).where(DagRun.dag_id == dag_id)).one()
    assert state == "success"


def _states(sessions: sessionmaker[Session], dag_id: str) -> dict[str, str]:
    """task or task[map_index] -> state."""
    with sessions() as session:
        tis = session.scalars(select(TaskInstance).where(TaskInstance.dag_id == dag_id)).all()
    return {
        ti.task_id if ti.map_index < 0 else f"{ti.task_id}[{ti.map_index}]": ti.state for ti in tis
    }


def _xcom(sessions: sessionmaker[Session], dag_id: str, task_id: str) -> Any:
    with sessions() as session:
        run_id = session.scalars(select(DagRun.run_id).where(DagRun.dag_id == dag_id)).one()
    return DatabaseXComs(sessions).pull(dag_id, run_id, task_id, "return_value", None)


def _went_through(sessions: sessionmaker[Session], dag_id: str, task_id: str) -> list[str]:
    """The states each task instance of ``task_id`` moved to, one list per map index."""
    with sessions() as session:
        rows = session.execute(
            select(TaskInstance.map_index, TaskStateChange.to_state, TaskStateChange.reason)
            .join(TaskInstance, TaskInstance.id == TaskStateChange.task_instance_id)
            .where(TaskInstance.dag_id == dag_id, TaskInstance.task_id == task_id)
            .order_by(TaskStateChange.id)
        ).all()
    return [f"{row.map_index}:{row.to_state}:{row.reason}" for row in rows]


def test_taskflow_dag_with_mapping_sensor_group_branch_and_short_circuit(
    services: Services,
    write_dag: Any,
    sessions: sessionmaker[Session],
    stack: Stack,
    cipher: Cipher,
) -> None:
    write_dag("e2e_mapping_acceptance_dag", ACCEPTANCE_DAG)
    dag_id = "e2e_mapping_acceptance"

    def fire_once_deferred() -> None:
        # The sensor waits an hour: once it has deferred, its trigger fires (the test publishes
        # the event), so the deferral is certain however late a loaded machine runs it.
        wait_for(
            lambda: _states(sessions, dag_id).get("wait.pause") == "deferred",
            timeout=150,
            what="the sensor to defer",
        )
        fire_deferred(sessions, stack.broker, cipher, dag_id, "wait.pause")

    _run(services, sessions, dag_id, then=fire_once_deferred)

    assert _states(sessions, "e2e_mapping_acceptance") == {
        "orders": "success",
        "price[0]": "success",
        "price[1]": "success",
        "price[2]": "success",
        "total": "success",
        "wait.pause": "success",
        "wait.after_pause": "success",
        "route": "success",
        "big": "success",
        "small": "skipped",
        "join": "success",
        "worth_reporting": "success",
        "report": "skipped",
        "done": "success",
    }
    assert _xcom(sessions, "e2e_mapping_acceptance", "price") == [6, 10, 16]
    assert _xcom(sessions, "e2e_mapping_acceptance", "total") == 32
    assert _xcom(sessions, "e2e_mapping_acceptance", "route") == "big"
    pause = _went_through(sessions, "e2e_mapping_acceptance", "wait.pause")
    assert any(":deferred:" in change for change in pause), pause
    # The placeholder became map index 0 when the scheduler expanded it.
    assert _went_through(sessions, "e2e_mapping_acceptance", "price")[0] == (
        "0:none:expanded into 3 task instance(s), map indexes 0 to 2"
    )
    shown = services.run(
        "runs", "show", "e2e_mapping_acceptance", _run_id(sessions, "e2e_mapping_acceptance")
    )
    assert "  price[2]: success (try 1)" in shown.stdout, shown.stdout


def _run_id(sessions: sessionmaker[Session], dag_id: str) -> str:
    with sessions() as session:
        return session.scalars(select(DagRun.run_id).where(DagRun.dag_id == dag_id)).one()


def test_mapped_classic_operator_expand_kwargs_and_reduces(
    services: Services, write_dag: Any, sessions: sessionmaker[Session]
) -> None:
    write_dag("e2e_mapping_classic_dag", CLASSIC_DAG)
    _run(services, sessions, "e2e_mapping_classic")

    dag_id = "e2e_mapping_classic"
    # Literal values are templates ({{ ti.map_index }}), partial() arguments shared.
    assert _xcom(sessions, dag_id, "echo") == ["map 0 a", "map 1 b"]
    assert _xcom(sessions, dag_id, "reduce") == ["map 0 a", "map 1 b"]
    assert _xcom(sessions, dag_id, "add") == [3, 7]  # expand_kwargs over an upstream XCom
    assert _xcom(sessions, dag_id, "collect") == [3, 7]  # a TaskFlow reduce gets the list
    assert _xcom(sessions, dag_id, "kw") == ["literal", "one"]  # expand_kwargs, literal
    explained = services.run("tasks", "explain", dag_id, _run_id(sessions, dag_id), "echo")
    assert f"{dag_id}.{_run_id(sessions, dag_id)}.echo[1]: success" in explained.stdout
    rendered = services.run(
        "tasks", "render", dag_id, _run_id(sessions, dag_id), "echo", "--map-index", "1"
    )
    assert "echo $WHO 1 b" in rendered.stdout, rendered.stdout + rendered.stderr


def test_each_map_index_of_a_mapped_deferrable_operator_defers_on_its_own_trigger(
    services: Services, write_dag: Any, sessions: sessionmaker[Session]
) -> None:
    write_dag("e2e_mapping_deferrable_dag", DEFERRABLE_DAG)
    _run(services, sessions, "e2e_mapping_deferrable")

    dag_id = "e2e_mapping_deferrable"
    changes = _went_through(sessions, dag_id, "wait")
    deferrals = [c for c in changes if ":deferred:" in c]
    assert sorted(c.split(":")[0] for c in deferrals) == ["0", "1", "2"], changes
    triggers = {c.rsplit(" ", 1)[1] for c in deferrals}  # "deferred to trigger <id>"
    assert len(triggers) == 3
    resumed = [c for c in changes if c.endswith(":resumed")]
    assert len(resumed) == 3, changes
    assert _xcom(sessions, dag_id, "wait") == ["0 waited 3s", "1 waited 4s", "2 waited 5s"]
    assert _xcom(sessions, dag_id, "reduce") == ["0 waited 3s", "1 waited 4s", "2 waited 5s"]


def test_an_empty_expansion_skips_the_mapped_task_and_its_downstream(
    services: Services, write_dag: Any, sessions: sessionmaker[Session]
) -> None:
    write_dag("e2e_mapping_empty_dag", EMPTY_DAG)
    _run(services, sessions, "e2e_mapping_empty")

    assert _states(sessions, "e2e_mapping_empty") == {
        "nothing": "success",
        "handle": "skipped",
        "after": "skipped",
        "cleanup": "success",
    }
    changes = _went_through(sessions, "e2e_mapping_empty", "handle")
    assert changes[-1].startswith("-1:skipped:nothing to map over"), changes
