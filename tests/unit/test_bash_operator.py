"""BashOperator, running real bash processes (no database)."""

from __future__ import annotations

import datetime as dt
import os
from pathlib import Path
from typing import Any

import pytest

from deferral import DAG
from deferral.context import Context, DagRunInfo, RuntimeTaskInstance
from deferral.exceptions import DagDefinitionError, SkipTask, TaskExecutionTimeout
from deferral.operators import BashOperator
from deferral.operators.bash import BashCommandError
from tests.helpers import process_alive as alive
from tests.helpers import wait_for
from worker.attempt import _time_limit

LOGICAL = dt.datetime(2024, 5, 1, tzinfo=dt.UTC)


class NoXComs:
    def push(self, task_instance_id: int, key: str, value: Any) -> None:
        raise AssertionError("no XCom expected")

    def pull(self, dag_id: str, run_id: str, task_id: str, key: str, map_index: int | None) -> Any:
        raise AssertionError("no XCom expected")


def context_for(op: BashOperator) -> Context:
    assert op.dag is not None
    ti = RuntimeTaskInstance(7, op.dag.dag_id, "run_1", op.task_id, -1, 3, NoXComs(), LOGICAL)
    return {
        "ti": ti,
        "task": op,
        "dag": op.dag,
        "dag_run": DagRunInfo(op.dag.dag_id, "run_1", LOGICAL),
        "run_id": "run_1",
        "logical_date": LOGICAL,
        "params": {},
        "try_number": 3,
    }


def bash(command: str, **kwargs: Any) -> Any:
    with DAG("bash_dag"):
        op = BashOperator(task_id="sh", bash_command=command, **kwargs)
    return op.execute(context_for(op))


def test_the_last_line_of_output_is_returned_and_every_line_printed(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert bash("echo first; echo second >&2; echo '  last  '") == "  last"
    assert capsys.readouterr().out.splitlines() == ["first", "second", "  last"]


def test_a_command_without_output_returns_an_empty_string() -> None:
    assert bash("true") == ""


def test_env_replaces_the_environment_unless_append_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FROM_WORKER", "w")
    assert bash('echo "${MINE}-${FROM_WORKER:-unset}"', env={"MINE": "m"}) == "m-unset"
    assert bash('echo "${MINE}-${FROM_WORKER}"', env={"MINE": "m"}, append_env=True) == "m-w"
    assert bash('echo "${FROM_WORKER}"') == "w"


def test_the_runs_ids_are_exported_under_deferral_and_airflow_names() -> None:
    out = bash(
        'echo "$DEFERRAL_CTX_DAG_ID $DEFERRAL_CTX_TASK_ID $DEFERRAL_CTX_DAG_RUN_ID'
        ' $DEFERRAL_CTX_TRY_NUMBER $AIRFLOW_CTX_DAG_ID $AIRFLOW_CTX_EXECUTION_DATE"',
        env={},
    )
    assert out == f"bash_dag sh run_1 3 bash_dag {LOGICAL.isoformat()}"


def test_cwd_is_used_and_the_default_is_a_temporary_directory_removed_after(
    tmp_path: Path,
) -> None:
    assert bash("pwd", cwd=str(tmp_path)) == str(tmp_path)
    scratch = bash("pwd")
    assert Path(scratch).name.startswith("deferral-bash-")
    assert not Path(scratch).exists()


def test_exit_code_99_skips_and_other_codes_fail_naming_the_code() -> None:
    with pytest.raises(SkipTask, match="exited with code 99"):
        bash("exit 99")
    with pytest.raises(BashCommandError, match="bash command failed with exit code 3"):
        bash("echo partial; exit 3")
    with pytest.raises(BashCommandError, match="exit code 99"):
        bash("exit 99", skip_on_exit_code=None)
    with pytest.raises(SkipTask, match="code 4"):
        bash("exit 4", skip_on_exit_code=[3, 4])
    assert bash("echo fine", skip_on_exit_code=0) == "fine"


def test_output_encoding_decodes_and_bad_bytes_do_not_break_the_task() -> None:
    assert bash(r"printf 'caf\xe9\n'", output_encoding="latin-1") == "café"
    assert bash(r"printf 'caf\xe9\n'") == "caf\\xe9"


def test_missing_or_file_cwd_fails_naming_it(tmp_path: Path) -> None:
    missing = tmp_path / "missing"
    with pytest.raises(BashCommandError, match=f"cwd '{missing}' does not exist"):
        bash("true", cwd=str(missing))
    a_file = tmp_path / "f"
    a_file.write_text("")
    with pytest.raises(BashCommandError, match="is not a directory"):
        bash("true", cwd=str(a_file))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"bash_command": ""}, "bash_command must be a non-empty string"),
        ({"bash_command": 5}, "bash_command must be a non-empty string"),
        ({"bash_command": "x", "env": ["A=1"]}, "env must be a dict of str to str"),
        ({"bash_command": "x", "env": {"A": 1}}, r"env\['A'\] must be a str, got int"),
        ({"bash_command": "x", "cwd": 5}, "cwd must be a path string"),
        ({"bash_command": "x", "output_encoding": "nope"}, "unknown output_encoding 'nope'"),
        ({"bash_command": "x", "skip_on_exit_code": "99"}, "skip_on_exit_code must be an int"),
    ],
)
def test_bad_arguments_are_refused_naming_the_task_and_argument(
    kwargs: dict[str, Any], message: str
) -> None:
    with DAG("bash_dag"), pytest.raises(DagDefinitionError, match=f"task 'sh': {message}"):
        BashOperator(task_id="sh", **kwargs)


def test_a_timeout_stops_the_whole_process_group(tmp_path: Path) -> None:
    """execution_timeout is SIGALRM in the task process: the command and what it started in
    the background are all stopped, none left running."""
    bg_pid, bash_pid = tmp_path / "bg.pid", tmp_path / "bash.pid"
    command = f"sleep 300 & echo $! > {bg_pid}; echo $$ > {bash_pid}; sleep 300"
    deadline = dt.datetime.now(dt.UTC) + dt.timedelta(seconds=1)
    with pytest.raises(TaskExecutionTimeout), _time_limit(deadline):
        bash(command)
    pids = [int(bg_pid.read_text()), int(bash_pid.read_text())]
    wait_for(lambda: not any(alive(pid) for pid in pids), timeout=10, what="no process left")


def test_on_kill_stops_a_running_command(tmp_path: Path) -> None:
    import threading

    with DAG("bash_dag"):
        op = BashOperator(task_id="sh", bash_command=f"echo $$ > {tmp_path / 'p'}; sleep 300")
    outcome: list[BaseException] = []

    def run() -> None:
        try:
            op.execute(context_for(op))
        except BaseException as exc:
            outcome.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    pid_file = tmp_path / "p"
    wait_for(lambda: pid_file.exists() and pid_file.read_text().strip(), what="bash to start")
    pid = int(pid_file.read_text())
    assert os.getpgid(pid) == pid  # it leads a process group of its own
    op.on_kill()
    thread.join(timeout=20)
    assert not thread.is_alive()
    assert isinstance(outcome[0], BashCommandError)  # killed by SIGTERM: exit code -15
    assert not alive(pid)
