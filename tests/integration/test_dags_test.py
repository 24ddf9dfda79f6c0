"""`deferral dags test` run as a subprocess against the test database with no service running:
the run's tasks run in that one process in dependency order, deferrals included, the run is
recorded in Postgres, and the exit status says how it ended."""

from __future__ import annotations

import datetime as dt
import os
import subprocess
import sys
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from deferral.runtime.config import Settings
from deferral.store import liveness
from deferral.store.tables import DagRun, Scheduler, TaskInstance, TaskLog, Trigger
from tests.forks import LANE
from tests.parsed_dags import record_dags_folder

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
TIMEOUT_SEC = 180


def deferral(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    """``deferral ARGS`` in a process of its own (forked with the CLI imported: tests/forks.py)."""
    return LANE.run(list(args), {**os.environ, **env}, TIMEOUT_SEC)


def states(sessions: sessionmaker[Session], dag_id: str) -> dict[str, str]:
    with sessions() as session:
        return {
            ti.task_id if ti.map_index < 0 else f"{ti.task_id}[{ti.map_index}]": ti.state
            for ti in session.scalars(select(TaskInstance).where(TaskInstance.dag_id == dag_id))
        }


def test_the_deferrable_example_runs_in_one_process_and_exits_0(
    service_env: dict[str, str], sessions: sessionmaker[Session]
) -> None:
    env = {**service_env, "DEFERRAL_DAGS_FOLDER": str(EXAMPLES)}
    done = deferral(env, "dags", "test", "example_deferrable", "--conf", '{"wait_seconds": 1}')
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert "wait: running -> deferred (deferred to trigger" in out
    assert "wait: deferred -> scheduled (trigger" in out
    assert "wait: queued -> running (resumed)" in out
    # The task's own lines, as they come, between its state changes.
    assert out.index("report | the wait took") < out.index("report: running -> success")
    assert out.rstrip().endswith(": success")
    with sessions() as session:
        run = session.scalars(select(DagRun).where(DagRun.dag_id == "example_deferrable")).one()
        assert (run.state, run.conf) == ("success", {"wait_seconds": 1})
        assert session.scalars(select(Trigger)).all() == []  # dropped on resume
        logged = session.scalars(select(TaskLog.text)).all()
    assert states(sessions, "example_deferrable") == {"wait": "success", "report": "success"}
    # The try's log is stored as a worker stores it: `deferral tasks logs` shows it.
    assert any("the wait took" in line for line in logged)
    assert any("deferred to trigger" in line for line in logged)


SHAPES = """
import datetime as dt
from pathlib import Path

from deferral import DAG, BaseOperator
from deferral.decorators import task
from deferral.operators.empty import EmptyOperator
from deferral.operators.python import BranchPythonOperator, PythonOperator
from deferral.triggers.base import BaseTrigger


class Never(BaseTrigger):
    def serialize(self):
        return ("{module}.Never", {{}})

    async def run(self):
        import asyncio
        await asyncio.sleep(3600)
        yield None


class WaitsForever(BaseOperator):
    def execute(self, context):
        self.defer(trigger=Never(), method_name="execute", timeout=dt.timedelta(seconds=1))


MARK = Path(__file__).with_suffix(".tried")


def fails_once():
    if not MARK.exists():
        MARK.write_text("1")
        raise RuntimeError("first try fails")


with DAG("{dag_id}", schedule=None, params={{"choice": "left"}}) as dag:
    @task
    def numbers():
        return [1, 2, 3]

    @task
    def double(x):
        print(f"doubling {{x}}")
        return 2 * x

    @task
    def total(xs):
        assert sum(xs) == 12
        return sum(xs)

    branch = BranchPythonOperator(
        task_id="branch", python_callable=lambda params: params["choice"]
    )
    left, right = EmptyOperator(task_id="left"), EmptyOperator(task_id="right")
    retried = PythonOperator(
        task_id="retried", python_callable=fails_once, retries=1,
        retry_delay=dt.timedelta(seconds=1),
    )
    total(double.expand(x=numbers())) >> branch >> [left, right]
    left >> retried >> WaitsForever(task_id="times_out") >> EmptyOperator(task_id="after")
"""


def test_mapping_branches_retries_and_a_deferral_timeout_end_as_the_services_end_them(
    service_env: dict[str, str],
    sessions: sessionmaker[Session],
    write_dag: Callable[[str, str], Path],
) -> None:
    name = f"shapes_{uuid.uuid4().hex[:8]}"
    write_dag(name, SHAPES.format(module=name, dag_id=name))
    env = {**service_env, "DEFERRAL_TRIGGER_MODULES": f"deferral.triggers,{name}"}
    done = deferral(env, "dags", "test", name, "2024-03-01")
    assert done.returncode == 1, done.stdout + done.stderr
    assert states(sessions, name) == {
        "numbers": "success",
        "double[0]": "success",
        "double[1]": "success",
        "double[2]": "success",
        "total": "success",
        "branch": "success",
        "left": "success",
        "right": "skipped",
        "retried": "success",
        "times_out": "failed",
        "after": "upstream_failed",
    }
    assert "double[1] | doubling 2" in done.stdout
    assert "retried: running -> up_for_retry (RuntimeError: first try fails)" in done.stdout
    assert "times_out: deferred -> scheduled (trigger timeout passed)" in done.stdout
    assert "TaskDeferralTimeout" in done.stdout
    assert done.stdout.rstrip().endswith(": failed")
    with sessions() as session:
        run = session.scalars(select(DagRun).where(DagRun.dag_id == name)).one()
    assert run.logical_date == dt.datetime(2024, 3, 1, tzinfo=dt.UTC)
    assert run.run_id == "manual__2024-03-01T00:00:00+00:00"


def test_a_live_scheduler_on_the_database_is_named_and_nothing_runs(
    service_env: dict[str, str], sessions: sessionmaker[Session], cli_dag: str
) -> None:
    with sessions.begin() as session:
        liveness.heartbeat(
            session,
            Scheduler,
            {"name": "sched-1", "hostname": "box", "pid": 1, "state": liveness.RUNNING},
        )
    # Alive for a minute after its last heartbeat: longer than this command takes to start.
    done = deferral({**service_env, "DEFERRAL_HEARTBEAT_SEC": "30"}, "dags", "test", cli_dag)
    assert done.returncode == 1
    assert done.stderr.strip().startswith("error: scheduler sched-1 (on box) runs against")
    with sessions() as session:
        assert session.scalars(select(DagRun)).all() == []


def test_bad_input_gets_one_line(
    service_env: dict[str, str],
    sessions: sessionmaker[Session],
    write_dag: Callable[[str, str], Path],
) -> None:
    name = f"param_{uuid.uuid4().hex[:8]}"
    write_dag(
        name,
        "from deferral import DAG\nfrom deferral.models.param import Param\n"
        "from deferral.operators.empty import EmptyOperator\n"
        f"with DAG('{name}', params={{'n': Param(1, type='integer')}}):\n"
        "    EmptyOperator(task_id='t')\n",
    )
    write_dag(f"broken_{uuid.uuid4().hex[:8]}", "raise RuntimeError('boom')\n")
    for args, said in (
        (["nope"], "DAG 'nope' not found in"),
        (["nope"], "; 1 DAG file fails to import: "),
        (["nope"], ".py: RuntimeError: boom"),
        ([name, "--conf", '{"n": "x"}'], "'x' is not of type 'integer'"),
        ([name, "--conf", "[1]"], "--conf"),
        ([name, "yesterday"], "'yesterday' is not a date"),
    ):
        done = deferral(service_env, "dags", "test", *args)
        assert done.returncode in (1, 2), done.stdout + done.stderr
        assert said in done.stderr
    with sessions() as session:
        assert session.scalars(select(DagRun)).all() == []


def test_dags_trigger_takes_the_logical_date(
    settings: Settings, sessions: sessionmaker[Session], cli_dag: str
) -> None:
    record_dags_folder(settings)  # a trigger reads what a scheduler parsed
    for flag, day in (("--logical-date", "2024-05-01"), ("-e", "2024-05-02")):
        done = deferral({}, "dags", "trigger", cli_dag, flag, day)
        assert done.returncode == 0, done.stderr
        assert f"manual__{day}T00:00:00+00:00" in done.stdout
    again = deferral({}, "dags", "trigger", cli_dag, "--exec-date", "2024-05-01T00:00:00+00:00")
    assert again.returncode == 1
    assert "or one at 2024-05-01T00:00:00+00:00" in again.stderr
    with sessions() as session:
        dates = sorted(session.scalars(select(DagRun.logical_date)))
    assert dates == [dt.datetime(2024, 5, d, tzinfo=dt.UTC) for d in (1, 2)]


@pytest.fixture
def cli_dag(write_dag: Callable[[str, str], Path]) -> str:
    name = f"plain_{uuid.uuid4().hex[:8]}"
    write_dag(
        name,
        "from deferral import DAG\nfrom deferral.operators.empty import EmptyOperator\n"
        f"with DAG('{name}', schedule=None):\n    EmptyOperator(task_id='t')\n",
    )
    return name


def test_tasks_test_runs_one_task_and_records_no_state(
    service_env: dict[str, str], sessions: sessionmaker[Session]
) -> None:
    env = {**service_env, "DEFERRAL_DAGS_FOLDER": str(EXAMPLES)}
    # No run at that date: one is made for the test, the deferral runs here, and it is gone.
    # --task-params replaces the DAG's wait_seconds (3) for this test alone.
    done = deferral(
        env,
        *("tasks", "test", "example_deferrable", "wait", "2024-02-01"),
        *("-t", '{"wait_seconds": 0.1}'),
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "wait: deferred to deferral.triggers.temporal.TimeDeltaTrigger" in done.stdout
    assert "trigger fired at" in done.stdout and "waited 0.1s" in done.stdout
    assert done.stdout.rstrip().endswith("wait: success")
    with sessions() as session:
        assert session.scalars(select(DagRun)).all() == []
        assert session.scalars(select(TaskInstance)).all() == []
    # Dependencies are ignored: report runs alone, and without wait's XCom it fails (exit 1).
    alone = deferral(env, "tasks", "test", "example_deferrable", "report", "2024-02-01")
    assert alone.returncode == 1
    assert "report: failed: TypeError" in alone.stdout
    assert "Traceback" in alone.stderr

    # In an existing run, the task reads that run's XComs, and its state stays as it was.
    ran = deferral(
        env, "dags", "test", "example_deferrable", "2024-02-02", "-c", '{"wait_seconds": 0}'
    )
    assert ran.returncode == 0, ran.stdout + ran.stderr
    with sessions.begin() as session:
        report = session.scalars(select(TaskInstance).where(TaskInstance.task_id == "report")).one()
        report.state = "failed"  # as if it had failed: a test run must not change it
    again = deferral(env, "tasks", "test", "example_deferrable", "report", "2024-02-02")
    assert again.returncode == 0, again.stdout + again.stderr
    assert "the wait took" in again.stdout
    assert states(sessions, "example_deferrable") == {"wait": "success", "report": "failed"}
    unknown = deferral(env, "tasks", "test", "example_deferrable", "nope")
    assert (unknown.returncode, unknown.stderr.strip()) == (
        1,
        "error: DAG 'example_deferrable' has no task 'nope'",
    )


@pytest.mark.parametrize(
    ("task_params", "said"),
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "must be a JSON object"),
        ('{"count": "many"}', "DAG 'typed_params'"),
    ],
)
def test_task_params_that_are_not_a_json_object_or_fail_the_dags_params_are_refused(
    service_env: dict[str, str],
    sessions: sessionmaker[Session],
    write_dag: Callable[[str, str], Path],
    task_params: str,
    said: str,
) -> None:
    write_dag(
        "typed_params",
        """
from deferral import DAG
from deferral.models.param import Param
from deferral.operators.empty import EmptyOperator

with DAG("typed_params", schedule=None, params={"count": Param(1, type="integer")}):
    EmptyOperator(task_id="t")
""",
    )
    refused = deferral(service_env, "tasks", "test", "typed_params", "t", "-t", task_params)
    assert refused.returncode == 2, refused.stdout + refused.stderr
    (line,) = [s for s in refused.stderr.splitlines() if "--task-params" in s]
    assert said in line
    assert "Traceback" not in refused.stderr
    with sessions() as session:
        assert session.scalars(select(DagRun)).all() == []


def test_dag_test_at_the_bottom_of_a_dag_file_runs_it(
    service_env: dict[str, str],
    sessions: sessionmaker[Session],
    write_dag: Callable[[str, str], Path],
) -> None:
    name = f"main_{uuid.uuid4().hex[:8]}"
    path = write_dag(
        name,
        "import datetime as dt\n"
        "from deferral import DAG\n"
        "from deferral.decorators import task\n"
        "from deferral.sensors.time_delta import TimeDeltaSensorAsync\n"
        f"with DAG('{name}', schedule=None) as dag:\n"
        "    @task\n"
        "    def hello(params):\n"
        "        print('hello', params['who'])\n"
        "    TimeDeltaSensorAsync(task_id='nap', delta=dt.timedelta(seconds=1)) >> hello()\n"
        "if __name__ == '__main__':\n"
        "    state = dag.test(run_conf={'who': 'world'})\n"
        "    print('ended', state)\n",
    )
    done = subprocess.run(
        [sys.executable, str(path)],
        env={**os.environ, **service_env, "DEFERRAL_DAGS_FOLDER": "/nonexistent"},
        capture_output=True,
        text=True,
        timeout=TIMEOUT_SEC,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "nap: running -> deferred" in done.stdout
    assert "hello | hello world" in done.stdout
    assert done.stdout.rstrip().endswith("ended success")
    assert states(sessions, name) == {"nap": "success", "hello": "success"}


RESCHEDULED = """
from pathlib import Path

from deferral import DAG
from deferral.sensors.python import PythonSensor

HERE = Path(__file__).with_suffix("")


def second_poke():
    poked = HERE.with_suffix(".poked")
    if poked.exists():
        return True
    poked.write_text("once")
    return False


def said_done(context):
    HERE.with_suffix(".done").write_text(context["dag_run"].run_id)


with DAG("{dag_id}", schedule=None, on_success_callback=said_done) as dag:
    PythonSensor(task_id="sense", python_callable=second_poke, mode="reschedule", poke_interval=1)
"""


def test_a_reschedule_sensor_pokes_again_and_the_dag_callback_runs(
    service_env: dict[str, str],
    sessions: sessionmaker[Session],
    write_dag: Callable[[str, str], Path],
) -> None:
    name = f"resched_{uuid.uuid4().hex[:8]}"
    path = write_dag(name, RESCHEDULED.format(dag_id=name))
    done = deferral(service_env, "dags", "test", name)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "sense: running -> up_for_reschedule (poke again at" in done.stdout
    assert "sense: up_for_reschedule -> scheduled (reschedule due)" in done.stdout
    assert states(sessions, name) == {"sense": "success"}
    # The DAG's on_success_callback ran once the run ended, with the run in its context.
    with sessions() as session:
        run_id = session.scalars(select(DagRun.run_id).where(DagRun.dag_id == name)).one()
    assert path.with_suffix(".done").read_text() == run_id


AIRFLOW_FILE = """
import datetime as dt

from airflow import DAG
from airflow.operators.bash import BashOperator
from airflow.operators.python import BranchPythonOperator
from airflow.operators.empty import EmptyOperator
from airflow.sensors.time_delta import TimeDeltaSensorAsync
from airflow.utils.edgemodifier import Label

with DAG("{dag_id}", schedule=None, start_date=dt.datetime(2024, 1, 1), tags=["example"]):
    nap = TimeDeltaSensorAsync(task_id="nap", delta=dt.timedelta(seconds=1))
    choose = BranchPythonOperator(task_id="choose", python_callable=lambda: "say")
    say = BashOperator(task_id="say", bash_command="echo from airflow")
    nap >> choose >> Label("yes") >> say
    choose >> Label("no") >> EmptyOperator(task_id="other")
"""


def test_an_unmodified_airflow_file_runs_when_its_folder_says_airflow_imports(
    service_env: dict[str, str],
    sessions: sessionmaker[Session],
    dags_folder: Path,
    write_dag: Callable[[str, str], Path],
) -> None:
    name = f"airflow_{uuid.uuid4().hex[:8]}"
    write_dag(name, AIRFLOW_FILE.format(dag_id=name))
    (dags_folder / ".deferral.toml").write_text("airflow_imports = true\n")
    done = deferral(service_env, "dags", "test", name)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "say | from airflow" in done.stdout
    assert states(sessions, name) == {
        "nap": "success",
        "choose": "success",
        "say": "success",
        "other": "skipped",
    }


HITL_DAG = """
import datetime as dt

from deferral import DAG
from deferral.operators.empty import EmptyOperator
from deferral.operators.hitl import HITLOperator

with DAG("hitl_local"):
    HITLOperator(
        task_id="ask",
        subject="Pick",
        options=["a", "b"],
        defaults="a",
        execution_timeout=dt.timedelta(seconds=1),
    ) >> EmptyOperator(task_id="after")
"""


def test_dags_test_waits_for_input_until_its_timeout_takes_the_default(
    service_env: dict[str, str],
    sessions: sessionmaker[Session],
    write_dag: Callable[[str, str], Path],
) -> None:
    write_dag("hitl_local", HITL_DAG)
    done = deferral(service_env, "dags", "test", "hitl_local")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "ask: running -> awaiting_input (awaiting input)" in done.stdout
    assert "ask: awaiting_input -> scheduled (response timeout passed)" in done.stdout
    assert states(sessions, "hitl_local") == {"ask": "success", "after": "success"}


def test_dags_test_of_one_file_imports_no_other_file_of_its_folder(
    service_env: dict[str, str], tmp_path: Path
) -> None:
    folder = tmp_path / "one_file_folder"
    folder.mkdir()
    marker = tmp_path / "imported"
    (folder / "a_other.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    dag_file = folder / "only_this.py"
    dag_file.write_text(
        "from deferral import DAG\nfrom deferral.operators import EmptyOperator\n"
        "with DAG('only_this') as dag:\n    EmptyOperator(task_id='t')\n"
    )
    done = deferral(service_env, "dags", "test", "only_this", "--subdir", str(dag_file))
    assert done.returncode == 0, done.stdout + done.stderr
    assert not marker.exists()
