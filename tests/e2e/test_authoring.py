"""TaskFlow, task groups, branching, BashOperator and callbacks through the real scheduler and
worker processes: one scheduler and one worker for the module, each test its own DAG."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from deferral.store import tasklogs
from deferral.store.tables import DagRun, TaskInstance, TaskStateChange
from deferral.store.xcom import DatabaseXComs
from tests.e2e.conftest import Services, shared_stack_fixtures
from tests.helpers import process_alive, wait_for

pytestmark = pytest.mark.e2e


stack, services, sessions, write_dag = shared_stack_fixtures(
    ("scheduler",), ("worker", "--concurrency", "2")
)


TASKFLOW_DAG = """
from deferral import TaskGroup, dag, task, task_group
from deferral.operators import EmptyOperator, PythonOperator


@task(multiple_outputs=True)
def extract():
    return {"orders": [3, 4], "customer": "ada"}


@task
def total(orders):
    return sum(orders)


@task
def greet(customer, amount):
    return f"{customer} owes {amount}"


@task
def scale(amount, factor):
    return amount * factor


def double(x):
    return x * 2


@task_group
def checks(value):
    @task
    def positive(v):
        return v > 0

    @task
    def small(v):
        return v < 100

    positive(value) >> small(value)


@dag(schedule=None)
def e2e_taskflow(factor=10):
    data = extract()
    amount = total(data["orders"])
    message = greet(data["customer"], amount)
    doubled = PythonOperator(task_id="double", python_callable=double, op_kwargs={"x": amount})
    scale(doubled.output, factor)
    with TaskGroup("first") as first:
        EmptyOperator(task_id="a") >> EmptyOperator(task_id="b")
        EmptyOperator(task_id="c")
    with TaskGroup("second", default_args={"retries": 2}) as second:
        EmptyOperator(task_id="x")
    message >> first >> second >> checks(amount)


e2e_taskflow()
"""

BRANCHING_DAG = """
from deferral import DAG, TaskGroup, task
from deferral.operators import BranchPythonOperator, EmptyOperator, ShortCircuitOperator

with DAG("e2e_branching"):
    branch = BranchPythonOperator(task_id="branch", python_callable=lambda: "left")
    left, right = EmptyOperator(task_id="left"), EmptyOperator(task_id="right")
    after_right = EmptyOperator(task_id="after_right")
    join = EmptyOperator(task_id="join", trigger_rule="none_failed_min_one_success")
    branch >> [left, right]
    right >> after_right
    [left, after_right] >> join

    @task.branch
    def pick_group():
        return "chosen"

    with TaskGroup("chosen") as chosen:
        EmptyOperator(task_id="one") >> EmptyOperator(task_id="two")
    with TaskGroup("unchosen") as unchosen:
        EmptyOperator(task_id="one")
    pick_group() >> [chosen, unchosen]

    gate_all = ShortCircuitOperator(task_id="gate_all", python_callable=lambda: False)
    all_done = EmptyOperator(task_id="sc_all_done", trigger_rule="all_done")
    gate_all >> EmptyOperator(task_id="sc_direct") >> all_done

    gate_rules = ShortCircuitOperator(
        task_id="gate_rules", python_callable=lambda: 0, ignore_downstream_trigger_rules=False
    )
    scr_direct = EmptyOperator(task_id="scr_direct")
    gate_rules >> scr_direct >> EmptyOperator(task_id="scr_all_done", trigger_rule="all_done")
    scr_direct >> EmptyOperator(task_id="scr_all_success")

    @task.short_circuit
    def open_gate():
        return True

    open_gate() >> EmptyOperator(task_id="after_open_gate")
"""

BASH_DAG = """
import datetime as dt

from deferral import DAG
from deferral.operators import BashOperator

with DAG("e2e_bash"):
    echo = BashOperator(
        task_id="echo",
        bash_command='echo first; echo "$DEFERRAL_CTX_TASK_ID $GREETING"',
        env={{"GREETING": "hi"}},
    )
    BashOperator(task_id="skip99", bash_command="echo skipping; exit 99")
    BashOperator(task_id="fails", bash_command="exit 3")
    # After echo, so that it starts in a task process already up: its timeout counts from
    # its pick-up, and a first task process can take seconds to start on a loaded machine.
    echo >> BashOperator(
        task_id="too_long",
        bash_command="sleep 300 & echo $! > {pids}; echo $$ >> {pids}; sleep 300",
        execution_timeout=dt.timedelta(seconds=5),
    )
"""

CALLBACKS_DAG = """
import datetime as dt
from pathlib import Path

from deferral import DAG
from deferral.operators import PythonOperator

LOG = Path({log!r})


def note(kind):
    def callback(context):
        error = context.get("exception")
        extra = f" {{type(error).__name__}}" if error else ""
        with LOG.open("a") as f:
            f.write(f"{{kind}} {{context['ti'].task_id}} {{context['try_number']}}{{extra}}\\n")

    return callback


def broken(context):
    raise RuntimeError("the pager is down")


def dag_note(kind):
    def callback(context):
        with LOG.open("a") as f:
            f.write(f"{{kind}} {{context['dag_run'].dag_id}} {{context['reason']}}\\n")

    return callback


def always_fails():
    raise ValueError("bad data")


with DAG(
    "e2e_callbacks",
    on_success_callback=dag_note("dag success"),
    on_failure_callback=[broken, dag_note("dag failure")],
    default_args={{
        "on_execute_callback": note("execute"),
        "on_success_callback": note("success"),
        "on_failure_callback": [broken, note("failure")],
        "on_retry_callback": note("retry"),
        "retry_delay": dt.timedelta(0),
    }},
):
    PythonOperator(task_id="fine", python_callable=lambda: 1)
    PythonOperator(task_id="flaky", python_callable=always_fails, retries=1)
"""


def _run_to_the_end(
    services: Services, sessions: sessionmaker[Session], dag_id: str, *, succeeds: bool = True
) -> None:
    result = services.run("dags", "trigger", dag_id, "--wait", "--timeout", "120", timeout=150)
    assert result.returncode == (0 if succeeds else 1), result.stdout + result.stderr
    with sessions() as session:
        state = session.scalars(select(DagRun.state).where(DagRun.dag_id == dag_id)).one()
    assert state == ("success" if succeeds else "failed")


def _task_instances(sessions: sessionmaker[Session], dag_id: str) -> dict[str, TaskInstance]:
    with sessions() as session:
        rows = session.scalars(select(TaskInstance).where(TaskInstance.dag_id == dag_id))
        return {ti.task_id: ti for ti in rows}


def _task_log(sessions: sessionmaker[Session], ti_id: int) -> str:
    """Every try's log of a task instance, as one text."""
    with sessions() as session:
        return "\n".join(
            line.text
            for try_number in tasklogs.tries_with_logs(session, ti_id)
            for line in tasklogs.read_lines(session, ti_id, try_number)
        )


def _states(sessions: sessionmaker[Session], dag_id: str) -> dict[str, str]:
    return {task_id: ti.state for task_id, ti in _task_instances(sessions, dag_id).items()}


def _last_reason(sessions: sessionmaker[Session], ti_id: int) -> str:
    with sessions() as session:
        reason = session.scalars(
            select(TaskStateChange.reason)
            .where(TaskStateChange.task_instance_id == ti_id)
            .order_by(TaskStateChange.id.desc())
        ).first()
    return reason or ""


def _xcom(sessions: sessionmaker[Session], dag_id: str, task_id: str, key: str) -> Any:
    with sessions() as session:
        run_id = session.scalars(select(DagRun.run_id).where(DagRun.dag_id == dag_id)).one()
    return DatabaseXComs(sessions).pull(dag_id, run_id, task_id, key, -1)


def test_taskflow_passes_values_and_task_groups_run_in_dependency_order(
    services: Services, write_dag: Any, sessions: sessionmaker[Session]
) -> None:
    write_dag("e2e_taskflow_dag", TASKFLOW_DAG)
    _run_to_the_end(services, sessions, "e2e_taskflow")

    tis = _task_instances(sessions, "e2e_taskflow")
    assert {ti.state for ti in tis.values()} == {"success"}, _states(sessions, "e2e_taskflow")
    assert set(tis) == {
        "extract", "total", "greet", "double", "scale",
        "first.a", "first.b", "first.c", "second.x", "checks.positive", "checks.small",
    }  # fmt: skip

    def value(task_id: str, key: str = "return_value") -> Any:
        return _xcom(sessions, "e2e_taskflow", task_id, key)

    assert value("extract", "orders") == [3, 4]  # multiple_outputs: each key its own XCom
    assert value("extract", "customer") == "ada"
    assert value("extract") == {"orders": [3, 4], "customer": "ada"}
    assert value("total") == 7
    assert value("greet") == "ada owes 7"
    assert value("double") == 14  # a classic operator given an XComArg in op_kwargs
    assert value("scale") == 140  # operator.output and a @dag param (factor=10)
    assert value("checks.positive") is True
    # group >> group: every root of "second" started after every leaf of "first" ended.
    first_leaves_end = max(tis[t].end_date for t in ("first.b", "first.c"))  # type: ignore[type-var]
    assert tis["second.x"].start_date >= first_leaves_end  # type: ignore[operator]
    assert tis["first.a"].start_date >= tis["greet"].end_date  # type: ignore[operator]
    assert tis["checks.positive"].start_date >= tis["second.x"].end_date  # type: ignore[operator]
    assert tis["second.x"].max_tries == 2  # the group's default_args


def test_branches_and_short_circuits_skip_what_they_chose_against(
    services: Services, write_dag: Any, sessions: sessionmaker[Session]
) -> None:
    write_dag("e2e_branching_dag", BRANCHING_DAG)
    _run_to_the_end(services, sessions, "e2e_branching")

    assert _states(sessions, "e2e_branching") == {
        "branch": "success",
        "left": "success",
        "right": "skipped",
        "after_right": "skipped",  # all_success after a skipped task: skipped by its rule
        "join": "success",  # none_failed_min_one_success after the branch
        "pick_group": "success",
        "chosen.one": "success",  # a task group id as the branch: its roots run
        "chosen.two": "success",
        "unchosen.one": "skipped",
        "gate_all": "success",
        "sc_direct": "skipped",
        "sc_all_done": "skipped",  # ignore_downstream_trigger_rules=True: all downstream
        "gate_rules": "success",
        "scr_direct": "skipped",
        "scr_all_done": "success",  # =False: beyond the direct downstream, rules decide
        "scr_all_success": "skipped",
        "open_gate": "success",
        "after_open_gate": "success",
    }
    tis = _task_instances(sessions, "e2e_branching")
    assert _last_reason(sessions, tis["right"].id) == "skipped by branch"
    assert _last_reason(sessions, tis["sc_all_done"].id) == "skipped by gate_all"
    assert _last_reason(sessions, tis["after_right"].id) == "trigger rule"
    assert _xcom(sessions, "e2e_branching", "branch", "return_value") == "left"


def test_bash_operator_pushes_its_last_line_skips_on_99_and_is_stopped_on_timeout(
    services: Services, write_dag: Any, sessions: sessionmaker[Session], tmp_path: Path
) -> None:
    pids = tmp_path / "bash.pids"
    write_dag("e2e_bash_dag", BASH_DAG.format(pids=pids))
    _run_to_the_end(services, sessions, "e2e_bash", succeeds=False)

    tis = _task_instances(sessions, "e2e_bash")
    assert _states(sessions, "e2e_bash") == {
        "echo": "success",
        "skip99": "skipped",
        "fails": "failed",
        "too_long": "failed",
    }
    assert _xcom(sessions, "e2e_bash", "echo", "return_value") == "echo hi"
    assert "exited with code 99" in _last_reason(sessions, tis["skip99"].id)
    assert _last_reason(sessions, tis["fails"].id) == (
        "BashCommandError: bash command failed with exit code 3"
    )
    assert _last_reason(sessions, tis["too_long"].id).startswith("TaskExecutionTimeout")
    started = [int(pid) for pid in pids.read_text().split()]
    assert len(started) == 2  # the background sleep and bash itself
    wait_for(
        lambda: not any(process_alive(pid) for pid in started),
        timeout=15,
        what="the timed-out command's processes to be gone",
    )
    assert "\necho hi\n" in _task_log(sessions, tis["echo"].id)  # the command's output


def test_task_callbacks_fire_in_the_task_process(
    services: Services, write_dag: Any, sessions: sessionmaker[Session], tmp_path: Path
) -> None:
    log = tmp_path / "callbacks.log"
    write_dag("e2e_callbacks_dag", CALLBACKS_DAG.format(log=str(log)))
    _run_to_the_end(services, sessions, "e2e_callbacks", succeeds=False)

    assert _states(sessions, "e2e_callbacks") == {"fine": "success", "flaky": "failed"}
    lines = log.read_text().splitlines()
    assert sorted(line for line in lines if "fine" in line) == ["execute fine 1", "success fine 1"]
    assert [line for line in lines if "flaky" in line] == [
        "execute flaky 1",
        "retry flaky 1 ValueError",
        "execute flaky 2",
        "failure flaky 2 ValueError",  # after a callback that raised, the next still ran
    ]
    flaky = _task_instances(sessions, "e2e_callbacks")["flaky"]
    assert _last_reason(sessions, flaky.id) == "ValueError: bad data"
    assert "the pager is down" in _task_log(sessions, flaky.id)
    # The DAG's failure callbacks run in the scheduler once the run has failed.
    wait_for(
        lambda: "dag failure e2e_callbacks task_failure" in log.read_text(),
        timeout=30,
        what="the DAG's failure callback",
    )
    assert "dag success" not in log.read_text()
    assert "the pager is down" in services.log("scheduler")


SETUP_TEARDOWN_DAG = """
import pendulum

from deferral import DAG
from deferral.decorators import setup, task, teardown

with DAG("e2e_setup_teardown", start_date=pendulum.datetime(2021, 1, 1, tz="UTC")):

    @setup
    def create_cluster():
        return "cluster-1"

    @task
    def work(cluster):
        raise ValueError(f"no luck on {cluster}")

    @task
    def not_reached():
        return 1

    @teardown
    def delete_cluster(cluster):
        return f"deleted {cluster}"

    cluster = create_cluster()
    with cluster >> delete_cluster(cluster):
        work(cluster) >> not_reached()
"""


def test_a_teardown_runs_after_failed_work_and_the_run_fails_with_the_work(
    services: Services, write_dag: Any, sessions: sessionmaker[Session]
) -> None:
    write_dag("e2e_setup_teardown_dag", SETUP_TEARDOWN_DAG)
    _run_to_the_end(services, sessions, "e2e_setup_teardown", succeeds=False)
    assert _states(sessions, "e2e_setup_teardown") == {
        "create_cluster": "success",
        "work": "failed",
        "not_reached": "upstream_failed",
        "delete_cluster": "success",
    }
    assert _xcom(sessions, "e2e_setup_teardown", "delete_cluster", "return_value") == (
        "deleted cluster-1"
    )


NESTED_SETUP_TEARDOWN_DAG = """
import pendulum

from deferral import DAG
from deferral.decorators import setup, task, task_group, teardown
from deferral.operators import BashOperator

with DAG("e2e_nested_setup_teardown", start_date=pendulum.datetime(2021, 1, 1, tz="UTC")):
    make_dir = BashOperator(task_id="make_dir", bash_command="echo made").as_setup()
    use_dir = BashOperator(task_id="use_dir", bash_command="echo used")
    drop_dir = BashOperator(task_id="drop_dir", bash_command="echo dropped")
    make_dir >> use_dir >> drop_dir.as_teardown(setups=make_dir)

    @setup
    def open_session():
        return "session-7"

    @teardown
    def close_session():
        return "closed"

    @task_group
    def section():
        @task
        def lease():
            return "lease-1"

        @task
        def use(lease_id):
            return f"used {lease_id}"

        @task
        def release(lease_id):
            return f"released {lease_id}"

        use(held := lease()) >> release(held).as_teardown(setups=held)

    opened, closed = open_session(), close_session()
    with opened >> closed:
        section()
"""


def test_nested_setups_and_teardowns_run_in_order_and_the_run_succeeds(
    services: Services, write_dag: Any, sessions: sessionmaker[Session]
) -> None:
    write_dag("e2e_nested_setup_teardown_dag", NESTED_SETUP_TEARDOWN_DAG)
    _run_to_the_end(services, sessions, "e2e_nested_setup_teardown")
    tis = _task_instances(sessions, "e2e_nested_setup_teardown")
    assert {ti.state for ti in tis.values()} == {"success"}, _states(
        sessions, "e2e_nested_setup_teardown"
    )
    # The outer session opens before the section's lease, closes after its work.
    assert tis["section.lease"].start_date >= tis["open_session"].end_date  # type: ignore[operator]
    assert tis["close_session"].start_date >= tis["section.use"].end_date  # type: ignore[operator]
    assert tis["drop_dir"].start_date >= tis["use_dir"].end_date  # type: ignore[operator]


# As Airflow's example_python_operator.py writes its virtualenv tasks (requirements from the
# system site packages only: nothing is downloaded).
VIRTUALENV_DAG = """
import logging
import sys

from deferral import DAG, task
from deferral.operators.python import ExternalPythonOperator, is_venv_installed

log = logging.getLogger(__name__)
PATH_TO_PYTHON_BINARY = sys.executable


def callable_external_python(ds):
    import sys

    print(f"running with {sys.executable} for {ds}")
    return sys.version_info[0]


with DAG("e2e_virtualenv", schedule=None) as dag:
    if not is_venv_installed():
        log.warning("The virtualenv_python example task requires virtualenv, please install it.")
    else:

        @task.virtualenv(task_id="virtualenv_python", requirements=[], system_site_packages=True)
        def callable_virtualenv(count):
            import json
            import sys

            print("inside the virtualenv:", sys.prefix)
            return json.dumps({"count": count})

        @task
        def read(text):
            return text.upper()

        read(callable_virtualenv(3))

    ExternalPythonOperator(
        task_id="external_python",
        python=PATH_TO_PYTHON_BINARY,
        python_callable=callable_external_python,
    )
"""


def test_virtualenv_and_external_python_tasks_run_in_other_pythons(
    services: Services, write_dag: Any, sessions: sessionmaker[Session]
) -> None:
    write_dag("e2e_virtualenv_dag", VIRTUALENV_DAG)
    _run_to_the_end(services, sessions, "e2e_virtualenv")

    assert _states(sessions, "e2e_virtualenv") == {
        "virtualenv_python": "success",
        "read": "success",
        "external_python": "success",
    }
    assert _xcom(sessions, "e2e_virtualenv", "read", "return_value") == '{"COUNT": 3}'
    assert _xcom(sessions, "e2e_virtualenv", "external_python", "return_value") == 3
    tis = _task_instances(sessions, "e2e_virtualenv")
    assert "deferral-venv-" in _task_log(sessions, tis["virtualenv_python"].id)
