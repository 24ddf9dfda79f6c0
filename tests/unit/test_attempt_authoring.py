"""worker.attempt for what authoring adds: callbacks (on_skipped_callback too), XComArgs resolved
before execute, the tasks a branch skips carried in the outcome, do_xcom_push, on_kill on
timeout."""

from __future__ import annotations

import datetime as dt
import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from deferral.runtime import serialization
from tests.helpers import process_alive as alive
from tests.helpers import wait_for
from worker import attempt
from worker.attempt import execute_attempt
from worker.outcomes import AttemptRequest, Failed, Skipped, Succeeded

LOGICAL = dt.datetime(2024, 2, 3, tzinfo=dt.UTC)

DAG_SOURCE = """
import datetime as dt
import time
from pathlib import Path

from deferral import DAG, BaseOperator, task
from deferral.exceptions import FailTask, SkipTask
from deferral.operators import BashOperator, BranchPythonOperator, EmptyOperator, PythonOperator

LOG = Path({log!r})


def note(kind):
    def callback(context):
        extra = ""
        if "exception" in context:
            extra = " " + type(context["exception"]).__name__
        with LOG.open("a") as f:
            f.write(f"{{kind}} {{context['ti'].task_id}} try {{context['try_number']}}{{extra}}\\n")
    return callback


def broken(context):
    raise RuntimeError("callback broke")


def raise_value_error():
    raise ValueError("task broke")


def raise_fail_task():
    raise FailTask("no retry for this")


class Stubborn(BaseOperator):
    def execute(self, context):
        time.sleep(30)

    def on_kill(self):
        note("killed")({{"ti": type("T", (), {{"task_id": self.task_id}})(), "try_number": 0}})


CALLBACKS = dict(
    on_execute_callback=note("execute"),
    on_success_callback=note("success"),
    on_failure_callback=note("failure"),
    on_retry_callback=note("retry"),
    on_skipped_callback=note("skipped"),
)

with DAG("auth_dag", default_args=CALLBACKS) as dag:
    PythonOperator(task_id="ok", python_callable=lambda: 5)
    PythonOperator(task_id="breaks", python_callable=raise_value_error)
    PythonOperator(task_id="fails_for_good", python_callable=raise_fail_task)
    PythonOperator(task_id="skips", python_callable=lambda: (_ for _ in ()).throw(SkipTask("x")))
    PythonOperator(task_id="unserializable", python_callable=lambda: object())
    PythonOperator(
        task_id="ok_despite_broken_callbacks",
        python_callable=lambda: 1,
        on_execute_callback=[broken, note("execute")],
        on_success_callback=[broken, note("success")],
    )
    PythonOperator(
        task_id="breaks_despite_broken_callbacks",
        python_callable=raise_value_error,
        on_failure_callback=[broken, note("failure")],
    )
    PythonOperator(task_id="not_pushed", python_callable=lambda: 5, do_xcom_push=False)
    Stubborn(task_id="stubborn", execution_timeout=dt.timedelta(seconds=0.5))
    BashOperator(
        task_id="bash_too_long",
        bash_command="sleep 300 & echo $! > {pids}; echo $$ >> {pids}; sleep 300",
        execution_timeout=dt.timedelta(seconds=1),
    )
    branch = BranchPythonOperator(task_id="branch", python_callable=lambda: "left")
    branch >> [EmptyOperator(task_id="left"), EmptyOperator(task_id="right")]

    @task
    def produce():
        return 20

    @task
    def consume(value, extra):
        return value + extra

    consume(produce(), extra=22)
"""


class MemoryXComs:
    def __init__(self) -> None:
        self.values: dict[tuple[str, str], Any] = {}

    def push(self, task_instance_id: int, key: str, value: Any) -> None:
        self.values[(str(task_instance_id), key)] = value

    def pull(self, dag_id: str, run_id: str, task_id: str, key: str, map_index: int | None) -> Any:
        return self.values.get((task_id, key))


@pytest.fixture
def files(attempt_dags: Callable[[str], Path], tmp_path: Path) -> dict[str, Path]:
    paths = {"log": tmp_path / "callbacks.log", "pids": tmp_path / "bash.pids"}
    attempt_dags(DAG_SOURCE.format(log=str(paths["log"]), pids=str(paths["pids"])))
    return paths


@pytest.fixture
def xcoms(monkeypatch: pytest.MonkeyPatch) -> MemoryXComs:
    memory = MemoryXComs()
    monkeypatch.setattr(attempt, "_xcoms", functools.cache(lambda: memory))
    return memory


def request(task_id: str, *, try_number: int = 1, max_tries: int = 0) -> AttemptRequest:
    return AttemptRequest(
        task_instance_id=41,
        dag_id="auth_dag",
        run_id="manual__1",
        task_id=task_id,
        map_index=-1,
        try_number=try_number,
        logical_date=LOGICAL,
        conf={},
        first_started_at=dt.datetime.now(dt.UTC),
        next_method=None,
        next_kwargs=None,
        max_tries=max_tries,
    )


def logged(files: dict[str, Path]) -> list[str]:
    log = files["log"]
    return log.read_text().splitlines() if log.exists() else []


def test_success_runs_the_execute_then_the_success_callback(files: dict[str, Path]) -> None:
    outcome = execute_attempt(request("ok"))
    assert outcome == Succeeded(5)
    assert logged(files) == ["execute ok try 1", "success ok try 1"]


def test_a_failure_with_tries_left_runs_on_retry_callback_with_the_exception(
    files: dict[str, Path],
) -> None:
    outcome = execute_attempt(request("breaks", try_number=1, max_tries=1))
    assert isinstance(outcome, Failed) and outcome.allow_retry
    assert logged(files) == ["execute breaks try 1", "retry breaks try 1 ValueError"]


def test_the_last_failure_runs_on_failure_callback(files: dict[str, Path]) -> None:
    outcome = execute_attempt(request("breaks", try_number=2, max_tries=1))
    assert isinstance(outcome, Failed)
    assert logged(files)[-1] == "failure breaks try 2 ValueError"


def test_fail_task_runs_on_failure_callback_even_with_tries_left(files: dict[str, Path]) -> None:
    outcome = execute_attempt(request("fails_for_good", try_number=1, max_tries=3))
    assert isinstance(outcome, Failed) and not outcome.allow_retry
    assert logged(files)[-1] == "failure fails_for_good try 1 FailTask"


def test_a_task_that_skips_itself_runs_on_skipped_callback(files: dict[str, Path]) -> None:
    # As Airflow 2.10: on_skipped_callback, from default_args here, and no other finishing one.
    assert isinstance(execute_attempt(request("skips")), Skipped)
    assert logged(files) == ["execute skips try 1", "skipped skips try 1"]


def test_an_unserializable_return_value_is_a_failure_with_its_callback(
    files: dict[str, Path],
) -> None:
    outcome = execute_attempt(request("unserializable", max_tries=2))
    assert isinstance(outcome, Failed) and "return value of task 'unserializable'" in outcome.error
    assert logged(files)[-1] == "failure unserializable try 1 SerializationError"


def test_callbacks_that_raise_change_nothing(files: dict[str, Path]) -> None:
    assert execute_attempt(request("ok_despite_broken_callbacks")) == Succeeded(1)
    assert logged(files) == [
        "execute ok_despite_broken_callbacks try 1",
        "success ok_despite_broken_callbacks try 1",
    ]
    outcome = execute_attempt(request("breaks_despite_broken_callbacks"))
    assert isinstance(outcome, Failed) and outcome.error == "ValueError: task broke"
    assert logged(files)[-1] == "failure breaks_despite_broken_callbacks try 1 ValueError"


def test_do_xcom_push_false_returns_nothing(files: dict[str, Path]) -> None:
    assert execute_attempt(request("not_pushed")) == Succeeded(None)


def test_a_timeout_calls_on_kill_then_the_callback(files: dict[str, Path]) -> None:
    outcome = execute_attempt(request("stubborn", max_tries=1))
    assert isinstance(outcome, Failed) and outcome.error.startswith("TaskExecutionTimeout")
    assert logged(files) == [
        "execute stubborn try 1",
        "killed stubborn try 0",
        "retry stubborn try 1 TaskExecutionTimeout",
    ]


def test_a_bash_command_past_its_timeout_is_stopped_with_its_whole_group(
    files: dict[str, Path],
) -> None:
    outcome = execute_attempt(request("bash_too_long"))
    assert isinstance(outcome, Failed) and outcome.error.startswith("TaskExecutionTimeout")
    pids = [int(line) for line in files["pids"].read_text().split()]
    assert len(pids) == 2
    wait_for(lambda: not any(alive(pid) for pid in pids), timeout=10, what="no process left")


def test_a_branch_reports_the_tasks_to_skip(files: dict[str, Path]) -> None:
    outcome = execute_attempt(request("branch"))
    assert outcome == Succeeded("left", skip_task_ids=("right",))


def test_xcomargs_are_pulled_before_execute(files: dict[str, Path], xcoms: MemoryXComs) -> None:
    xcoms.values[("produce", "return_value")] = 20
    outcome = execute_attempt(request("consume"))
    assert isinstance(outcome, Succeeded)
    assert serialization.from_jsonable(outcome.return_value) == 42
