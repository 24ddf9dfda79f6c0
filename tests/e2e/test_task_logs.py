"""Task logs through real processes: a task defers, resumes, prints, logs and raises; `deferral
tasks logs`, run from another directory than the worker's, shows it all in order, with the
worker's and the triggerer's lines about the try."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.e2e.conftest import CLI, Services, command

pytestmark = pytest.mark.e2e

DAG = """
import datetime as dt
import logging

from deferral import DAG, BaseOperator
from deferral.triggers import TimeDeltaTrigger


class DefersThenFails(BaseOperator):
    def execute(self, context):
        print("about to defer")
        self.defer(trigger=TimeDeltaTrigger(dt.timedelta(seconds=1)), method_name="resume")

    def resume(self, context, event=None):
        print("printed after the resume")
        logging.getLogger("e2e.logs").warning("logged after the print")
        raise ValueError("raised after the log")


with DAG("e2e_logs") as dag:
    DefersThenFails(task_id="t")
"""


def test_a_tasks_log_shows_its_output_and_the_triggerers_lines_in_order(
    services: Services, dags_folder: Path, tmp_path: Path
) -> None:
    (dags_folder / "e2e_logs_dag.py").write_text(DAG)
    worker_home, elsewhere = tmp_path / "worker_home", tmp_path / "elsewhere"
    worker_home.mkdir()
    elsewhere.mkdir()
    services.start("scheduler")
    services.spawn(
        "worker",
        command("worker", "consume", "--name", "w1", "--concurrency", "1"),
        services.env,
        worker_home,
    )
    services.start("triggerer", "--name", "t1")

    done = services.run("dags", "trigger", "e2e_logs", "--run-id", "r1", "--wait", timeout=180)
    assert done.returncode == 1, done.stdout + done.stderr  # the task failed, as it should

    shown = CLI.run(["tasks", "logs", "e2e_logs", "r1", "t"], services.env, 60, cwd=elsewhere)
    assert shown.returncode == 0, shown.stderr
    lines = shown.stdout.splitlines()
    assert lines[0] == "# e2e_logs.r1.t try 1"
    expected = [
        "worker    try 1 started on worker w1",
        "task      about to defer",
        "worker    deferred to trigger",
        "triggerer INFO deferral.triggerer: trigger",  # ... started on triggerer t1
        "triggerer INFO deferral.triggerer: trigger",  # ... fired: <the moment>
        "worker    try 1 started on worker w1",  # ..., resuming at resume
        "task      printed after the resume",
        "task      WARNING e2e.logs: logged after the print",
        "worker    failed, now failed: ValueError: raised after the log",
    ]
    # Each line: time, source, text; the traceback's lines follow the last.
    texts = [line.split(" ", 1)[1] for line in lines[1 : len(expected) + 1]]
    for text, start in zip(texts, expected, strict=True):
        assert text.startswith(start), (text, start, shown.stdout)
    assert texts[3].endswith("started on triggerer t1") and " fired: " in texts[4]
    assert texts[5].endswith("resuming at resume")
    assert "Traceback (most recent call last):" in shown.stdout
    assert lines[-1] == "ValueError: raised after the log"
