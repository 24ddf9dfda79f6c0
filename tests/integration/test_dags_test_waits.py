"""`deferral dags test` as a process of its own against the test database: what can run at once
runs at once, a signal wait and a request for input are answered from another process with the
command it prints, and SIGTERM stops it (exit 143) leaving no process of its behind."""

from __future__ import annotations

import os
import pty
import re
import shlex
import signal
import subprocess
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import psutil
import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from deferral.store.tables import TaskInstance, TaskStateChange
from tests.e2e.conftest import command
from tests.forks import LANE, ForkedProcess
from tests.helpers import wait_for

TIMEOUT_SEC = 120


def start_dags_test(env: dict[str, str], output: Path, *args: str) -> ForkedProcess:
    """``deferral dags test ARGS`` started in a process of its own, its output in ``output``."""
    return LANE.spawn("deferral", ["dags", "test", *args], {**os.environ, **env}, None, output)


@pytest.fixture
def dags_test(
    service_env: dict[str, str], write_dag: Callable[[str, str], Path], tmp_path: Path
) -> Callable[..., tuple[ForkedProcess, Path, str]]:
    """Write the DAG ``source`` (formatted with a fresh ``dag_id`` and ``fields``) and start
    ``deferral dags test`` on it; returns the process, its output file and the DAG id."""

    def start(source: str, **fields: str) -> tuple[ForkedProcess, Path, str]:
        name = f"dag_{uuid.uuid4().hex[:8]}"
        write_dag(name, source.format(dag_id=name, **fields))
        output = tmp_path / f"{name}.out"
        return start_dags_test(service_env, output, name), output, name

    return start


def printed_command(output: Path, words: str) -> str:
    """The first line of ``output`` that runs ``deferral WORDS``, once printed."""
    pattern = re.compile(rf"^(?:DEFERRAL_\S+ )*deferral {words}\b.*$", re.MULTILINE)
    found = wait_for(
        lambda: pattern.search(output.read_text()), timeout=TIMEOUT_SEC, what=f"`{words}` line"
    )
    return found.group(0)


def answer(line: str, fernet_key: str, *more: str) -> str:
    """Run a printed line as a shell would (its ``NAME=value`` words are the command's only
    DEFERRAL_* settings, but for the Fernet key, set in the environment: a secret the line names
    and does not show); its output."""
    words = shlex.split(line)
    settings = dict(word.split("=", 1) for word in words if re.match(r"^DEFERRAL_\w+=", word))
    argv = [word for word in words if not re.match(r"^DEFERRAL_\w+=", word)]
    assert argv[0] == "deferral"
    env = {k: v for k, v in os.environ.items() if not k.startswith("DEFERRAL_")}
    env = {**env, **settings, "DEFERRAL_FERNET_KEY": fernet_key}
    done = LANE.run([*argv[1:], *more], env, TIMEOUT_SEC)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


AT_ONCE = """
import datetime as dt
import time

from deferral import DAG
from deferral.decorators import task
from deferral.sensors.time_delta import TimeDeltaSensorAsync

with DAG("{dag_id}", schedule=None):
    for n in range(4):
        TimeDeltaSensorAsync(task_id=f"nap{{n}}", delta=dt.timedelta(seconds=3))

    @task
    def busy(n):
        time.sleep(2)

    busy.override(task_id="busy0")(0)
    busy.override(task_id="busy1")(1)
"""


def changes(sessions: sessionmaker[Session], dag_id: str) -> dict[tuple[str, str], object]:
    """(task, to_state) -> when, for each of the DAG's task state changes."""
    with sessions() as session:
        rows = session.execute(
            select(TaskInstance.task_id, TaskStateChange.to_state, TaskStateChange.at)
            .join(TaskInstance, TaskInstance.id == TaskStateChange.task_instance_id)
            .where(TaskInstance.dag_id == dag_id)
        ).all()
    return {(task_id, to_state): at for task_id, to_state, at in rows}


def test_independent_sensors_and_tasks_run_at_once(
    sessions: sessionmaker[Session], dags_test: Callable[..., tuple[ForkedProcess, Path, str]]
) -> None:
    proc, output, name = dags_test(AT_ONCE)
    assert proc.wait(TIMEOUT_SEC) == 0, output.read_text()
    at = changes(sessions, name)
    naps = [f"nap{n}" for n in range(4)]
    # Every sensor deferred before any one's trigger fired: their waits overlapped.
    assert max(at[nap, "deferred"] for nap in naps) < min(at[nap, "scheduled"] for nap in naps)
    for nap in naps:
        assert (nap, "scheduled") in at  # deferred -> scheduled by its trigger's event
    # Both sleeping tasks were running before either ended.
    busy = ("busy0", "busy1")
    assert max(at[b, "running"] for b in busy) < min(at[b, "success"] for b in busy)
    assert "busy0: running -> success" in output.read_text()


SIGNALLED = """
import datetime as dt

from deferral import DAG, BaseOperator
from deferral.decorators import task
from deferral.operators.hitl import HITLOperator


class WaitForPayment(BaseOperator):
    def __init__(self, key, **kwargs):
        super().__init__(**kwargs)
        self.key = key

    def execute(self, context):
        self.wait_for_signal(
            self.key, lookback=dt.timedelta(minutes=10), timeout=dt.timedelta(hours=1)
        )

    def execute_complete(self, context, event):
        return event


with DAG("{dag_id}", schedule=None):
    @task
    def report(paid):
        print("paid", paid["amount"])

    @task
    def chosen(answer):
        print("chose", answer["chosen_options"])

    report(WaitForPayment(task_id="wait", key="{key}").output)
    chosen(HITLOperator(task_id="ask", subject="Ship it?", options=["yes", "no"]).output)
    WaitForPayment(task_id="never", key="never-sent")
"""


def test_waits_are_answered_from_another_process_and_sigterm_leaves_no_process(
    service_env: dict[str, str], dags_test: Callable[..., tuple[ForkedProcess, Path, str]]
) -> None:
    key = f"payment-{uuid.uuid4().hex[:8]}"
    proc, output, _ = dags_test(SIGNALLED, key=key)
    fernet_key = service_env["DEFERRAL_FERNET_KEY"]
    try:
        send = printed_command(output, f"signals send {key}")
        respond = printed_command(output, "approvals respond")
        said = output.read_text()
        assert f"# wait waits for a signal on '{key}'" in said
        assert "# ask awaits input: 'Ship it?' (options: yes, no)" in said
        assert "DEFERRAL_FERNET_KEY: as set in this terminal (a secret: not shown)" in said
        assert fernet_key not in said
        assert respond.endswith(" yes")  # the first option, as an example
        answer(send, fernet_key, "--payload", '{"amount": 42}')
        answer(respond.removesuffix(" yes"), fernet_key, "no")
        wait_for(lambda: "chosen | chose ['no']" in output.read_text(), what="the response")
        wait_for(lambda: "report | paid 42" in output.read_text(), what="the signal")
        # Its task processes (and their fork server) are up: they ran the attempts.
        descendants = psutil.Process(proc.pid).children(recursive=True)
        assert descendants
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(TIMEOUT_SEC) == 143, output.read_text()
    finally:
        proc.kill()
    out = output.read_text()
    assert "SignalError" not in out
    assert "ask: awaiting_input -> scheduled (responded by" in out
    assert out.count(f"deferral signals send {key}") == 1  # said once
    assert re.search(r"^stopped by SIGTERM; run \S+ of DAG \S+ is left as it is$", out, re.M)
    assert "Aborted!" not in out
    _, alive = psutil.wait_procs(descendants, timeout=30)
    assert alive == []


ASKED = """
from deferral import DAG
from deferral.decorators import task
from deferral.operators.hitl import HITLOperator

with DAG("{dag_id}", schedule=None):
    @task
    def chosen(answer):
        print("chose", answer["chosen_options"])

    chosen(HITLOperator(task_id="ask", subject="Ship it?", options=["yes", "no"]).output)
"""


def test_tasks_test_says_a_signal_wait_needs_dags_test(
    service_env: dict[str, str], write_dag: Callable[[str, str], Path]
) -> None:
    name = f"dag_{uuid.uuid4().hex[:8]}"
    write_dag(name, SIGNALLED.format(dag_id=name, key="k"))
    done = LANE.run(["tasks", "test", name, "wait"], {**os.environ, **service_env}, TIMEOUT_SEC)
    assert (done.returncode, done.stderr.strip().splitlines()[-1]) == (
        1,
        "error: wait waits for a signal, a callback or an asset event, which `tasks test`"
        " (recording no state) cannot receive; use `deferral dags test`",
    )


@pytest.mark.parametrize("concurrency", ["0", "x"])
def test_a_bad_concurrency_is_one_line(service_env: dict[str, str], concurrency: str) -> None:
    done = LANE.run(
        ["dags", "test", "any", "--concurrency", concurrency],
        {**os.environ, **service_env},
        TIMEOUT_SEC,
    )
    assert done.returncode == 2
    assert "--concurrency" in done.stderr


@contextmanager
def asking_on_a_terminal(
    service_env: dict[str, str], write_dag: Callable[[str, str], Path], output: Path
) -> Iterator[tuple[subprocess.Popen[bytes], int]]:
    """`deferral dags test` of a DAG asking for input, its stdin a terminal and its stdout the
    file ``output`` (as under `dags test | tee log`); yields the process and the terminal's
    other end, for typing."""
    name = f"dag_{uuid.uuid4().hex[:8]}"
    write_dag(name, ASKED.format(dag_id=name))
    leader, follower = pty.openpty()
    with output.open("w") as out:
        proc = subprocess.Popen(
            command("deferral", "dags", "test", name),
            env={**os.environ, **service_env},
            stdin=follower,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    os.close(follower)
    try:
        yield proc, leader
    finally:
        proc.kill()
        os.close(leader)


def test_on_a_terminal_a_request_for_input_is_asked_there(
    service_env: dict[str, str], write_dag: Callable[[str, str], Path], tmp_path: Path
) -> None:
    output = tmp_path / "out"
    with asking_on_a_terminal(service_env, write_dag, output) as (proc, leader):
        wait_for(
            lambda: "ask: respond here (yes / no): " in output.read_text(),
            timeout=TIMEOUT_SEC,
            what="the prompt",
        )
        os.write(leader, b"maybe\n")  # not an option: said, and asked again
        wait_for(lambda: output.read_text().count("ask: respond here") == 2, what="asked again")
        os.write(leader, b"no\n")
        assert proc.wait(TIMEOUT_SEC) == 0, output.read_text()
    out_text = output.read_text()
    assert "maybe" in out_text.split("ask: respond here")[1]  # the one-line refusal
    assert "chosen | chose ['no']" in out_text


def test_a_question_answered_from_another_shell_is_ended_in_the_terminal(
    service_env: dict[str, str], write_dag: Callable[[str, str], Path], tmp_path: Path
) -> None:
    """The question asked in the terminal ends when another shell answers, and the command
    exits cleanly (reading stdin with `input()` while stdout is a file aborted the interpreter's
    exit: "could not acquire lock for <stdin>", exit -6)."""
    output = tmp_path / "out"
    with asking_on_a_terminal(service_env, write_dag, output) as (proc, _):
        respond = printed_command(output, "approvals respond")
        wait_for(lambda: "ask: respond here" in output.read_text(), what="the prompt")
        answer(respond.removesuffix(" yes"), service_env["DEFERRAL_FERNET_KEY"], "no")
        assert proc.wait(TIMEOUT_SEC) == 0, output.read_text()
    out_text = output.read_text()
    assert "Fatal Python error" not in out_text
    # One option only: no "several" offered; the question is ended, not run into the next line.
    assert "ask: respond here (yes / no): (answered from another shell)\n" in out_text
    assert "chosen | chose ['no']" in out_text


def test_ctrl_c_with_a_question_on_screen_ends_its_line_and_stops(
    service_env: dict[str, str], write_dag: Callable[[str, str], Path], tmp_path: Path
) -> None:
    output = tmp_path / "out"
    with asking_on_a_terminal(service_env, write_dag, output) as (proc, _):
        wait_for(lambda: "ask: respond here" in output.read_text(), what="the prompt")
        proc.send_signal(signal.SIGINT)
        assert proc.wait(TIMEOUT_SEC) == 130, output.read_text()
    assert "ask: respond here (yes / no): \nstopped by SIGINT; run " in output.read_text()
