"""`deferral dags trigger --wait` against real services: exit 0 when the run succeeds, 1 when a
task fails, 3 when --timeout passes first (a task deferred for an hour); each task's state as it
changes, redrawn in place on a terminal; and the services' JSON log lines carry the task, try
and trigger ids. One set of processes serves the module."""

from __future__ import annotations

import json
import os
import pty
import signal
import subprocess
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from deferral.store.tables import DagRun, TaskInstance
from tests.e2e.conftest import Services, command, shared_stack_fixtures
from tests.helpers import wait_for

pytestmark = pytest.mark.e2e

DAGS = """
import datetime as dt

from deferral import DAG, BaseOperator
from deferral.operators import EmptyOperator, PythonOperator
from deferral.triggers import TimeDeltaTrigger


class Wait(BaseOperator):
    def __init__(self, seconds, **kwargs):
        super().__init__(**kwargs)
        self.seconds = seconds

    def execute(self, context):
        self.defer(trigger=TimeDeltaTrigger(dt.timedelta(seconds=self.seconds)), method_name="done")

    def done(self, context, event):
        return "waited"


def boom():
    raise ValueError("boom")


with DAG("e2e_wait_ok"):
    Wait(task_id="wait", seconds=3) >> EmptyOperator(task_id="after")

with DAG("e2e_wait_fail"):
    PythonOperator(task_id="boom", python_callable=boom) >> EmptyOperator(task_id="after")

with DAG("e2e_wait_long"):
    Wait(task_id="wait", seconds=3600)
"""


stack, services, sessions, write_dag = shared_stack_fixtures(
    ("scheduler",),
    ("worker", "--concurrency", "2", "--log-format", "json"),
    ("triggerer", "--log-format", "json"),
)


@pytest.fixture
def running(services: Services, write_dag: Callable[[str, str], Path]) -> Services:
    """The module's processes, with its DAGs."""
    write_dag("e2e_wait_dags", DAGS)
    return services


def _plain(lines: str) -> list[str]:
    """The lines of --wait's plain form, without their date, time of day and zone."""
    return [line.split(" ", 3)[3] for line in lines.splitlines() if line[:2].isdigit()]


def _trigger_and_wait(
    services: Services, dag_id: str, timeout: str
) -> subprocess.CompletedProcess[str]:
    """`deferral dags trigger DAG_ID --run-id r1 --wait --timeout S`, run to its end."""
    return services.run(
        "dags", "trigger", dag_id, "--run-id", "r1", "--wait", "--timeout", timeout, timeout=240
    )


def _json_lines(log: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in log.splitlines() if line.startswith("{")]


def test_wait_exits_0_when_the_run_succeeds(running: Services) -> None:
    done = _trigger_and_wait(running, "e2e_wait_ok", "180")
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.splitlines()[0] == "triggered e2e_wait_ok r1"
    shown = _plain(done.stdout)
    # Deferred for 3 s, polled every 0.5 s: the deferral is seen, then the success.
    wait_states = [line for line in shown if line.startswith("wait: ")]
    assert "wait: deferred (try 1)" in wait_states, shown
    assert wait_states[-1] == "wait: success (try 1)", shown
    assert {"run: running", "run: success", "after: success (try 1)"} <= set(shown)
    assert shown[-1] == "run: success"  # after its tasks' last states, not before them
    assert done.stdout.splitlines()[-1] == "run r1: success"
    assert "\x1b" not in done.stdout  # not a terminal: no control sequences

    # The JSON logs: ISO 8601 UTC timestamps, the ids of what a line is about as fields.
    worker = _json_lines(running.log("worker"))
    (started,) = [e for e in worker if e["message"] == "running e2e_wait_ok.r1.wait try 1"]
    assert started["task"] == "e2e_wait_ok.r1.wait" and started["try_number"] == 1
    assert isinstance(started["task_instance_id"], int)
    assert started["timestamp"].endswith("Z") and "T" in started["timestamp"]
    triggerer = _json_lines(running.log("triggerer"))
    (fired,) = [e for e in triggerer if " for e2e_wait_ok.r1.wait fired: " in e["message"]]
    # The event as plain JSON: the moment as an ISO 8601 string, not the stored encoding.
    assert fired["message"].endswith('+00:00"') and "__deferral_type__" not in fired["message"]
    assert fired["task_instance_id"] == started["task_instance_id"]
    assert isinstance(fired["trigger_id"], int) and fired["task"] == "e2e_wait_ok.r1.wait"


def test_wait_exits_1_when_a_task_fails(running: Services) -> None:
    done = _trigger_and_wait(running, "e2e_wait_fail", "180")
    assert done.returncode == 1, done.stdout + done.stderr
    shown = _plain(done.stdout)
    assert {"boom: failed (try 1)", "after: upstream_failed (try 0)", "run: failed"} <= set(shown)
    # The end names the failed task and the first line of its error.
    assert done.stdout.splitlines()[-2:] == ["run r1: failed", "failed: boom: ValueError: boom"]


def test_wait_exits_3_when_the_timeout_passes_first(
    running: Services, sessions: sessionmaker[Session]
) -> None:
    done = _trigger_and_wait(running, "e2e_wait_long", "2")
    assert done.returncode == 3, done.stdout + done.stderr
    assert done.stderr == (
        "error: run r1 of DAG e2e_wait_long not finished after 2s; it goes on"
        " (`deferral runs show e2e_wait_long r1`)\n"
    )
    assert "run r1:" not in done.stdout

    def state() -> str | None:
        with sessions() as session:
            return session.scalar(
                select(TaskInstance.state).where(
                    TaskInstance.dag_id == "e2e_wait_long", TaskInstance.task_id == "wait"
                )
            )

    # The run goes on: its task waits on its trigger.
    wait_for(lambda: state() == "deferred", timeout=60, what="the task to defer")


def test_ctrl_c_stops_waiting_with_130_and_the_run_goes_on(
    running: Services, sessions: sessionmaker[Session]
) -> None:
    running.parsed("e2e_wait_long")  # what `dags trigger` reads
    proc = subprocess.Popen(
        command("deferral", "dags", "trigger", "e2e_wait_long", "--run-id", "r3", "--wait"),
        env=running.env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline() == "triggered e2e_wait_long r3\n"
        # The first state line: the waiting has begun.
        assert proc.stdout.readline().split(" ", 3)[3].startswith("run: ")
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, repr(err)
    assert err.strip().splitlines()[-1] == (
        "stopped waiting; run r3 of DAG e2e_wait_long goes on"
        " (`deferral runs show e2e_wait_long r3`)"
    )
    assert "Aborted" not in err

    def run_state() -> str | None:
        with sessions() as session:
            return session.scalar(
                select(DagRun.state).where(DagRun.dag_id == "e2e_wait_long", DagRun.run_id == "r3")
            )

    # The run goes on without the waiting command.
    wait_for(lambda: run_state() == "running", timeout=60, what="run r3 to be running")


def _run_on_terminal(services: Services, *args: str, timeout: float) -> tuple[int, str]:
    """Run a `deferral` command with its stdout on a pseudo-terminal; its exit status and all it
    wrote there."""
    master, slave = pty.openpty()
    proc = subprocess.Popen(
        command("deferral", *args), env=services.env, stdout=slave, stderr=subprocess.PIPE
    )
    os.close(slave)
    chunks: list[bytes] = []

    def read() -> None:
        while True:
            try:
                data = os.read(master, 4096)
            except OSError:  # EIO: the terminal's other end closed
                return
            if not data:
                return
            chunks.append(data)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        code = proc.wait(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
        reader.join(10)
        os.close(master)
    return code, b"".join(chunks).decode(errors="replace")


def test_on_a_terminal_wait_redraws_the_tasks_in_place(running: Services) -> None:
    code, shown = _run_on_terminal(
        running,
        "dags",
        "trigger",
        "e2e_wait_ok",
        "--run-id",
        "r2",
        "--wait",
        "--timeout",
        "180",
        timeout=240,
    )
    assert code == 0, shown
    assert "\x1b[2K" in shown and "F\x1b[2K" in shown  # lines erased and the block redrawn
    final = shown.replace("\r\n", "\n").rsplit("\x1b[J", 1)
    assert final[-1].strip() == "run r2: success"
    last_block = final[0].rsplit("F", 1)[-1].replace("\x1b[2K", "").splitlines()
    assert last_block[0].startswith("e2e_wait_ok r2: success (")
    assert [line.split() for line in last_block[1:]] == [
        ["wait", "success", "try", "1"],
        ["after", "success", "try", "1"],
    ]
