"""`deferral dags test example_deferrable` with nothing configured and no service running: the
run goes to an embedded PostgreSQL (standalone mode's), the deferral's trigger runs in the
command's own process, and it exits 0."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from tests.e2e.conftest import command
from tests.helpers import wait_for

pytestmark = pytest.mark.e2e

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def dags_test(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``deferral dags test ARGS`` in ``cwd``, with no DEFERRAL_* setting at all."""
    return subprocess.run(
        command("deferral", "dags", "test", *args),
        cwd=cwd,
        env={k: v for k, v in os.environ.items() if not k.startswith("DEFERRAL_")},
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_dags_test_runs_the_deferrable_example_on_an_embedded_database(tmp_path: Path) -> None:
    done = dags_test(tmp_path, "example_deferrable", "--subdir", str(EXAMPLES))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "DEFERRAL_DATABASE_URL is not set: using an embedded PostgreSQL" in done.stderr
    assert "wait: running -> deferred (deferred to trigger" in done.stdout
    assert "wait: deferred -> scheduled (trigger" in done.stdout
    assert "report | the wait took" in done.stdout
    assert done.stdout.rstrip().endswith(": success")
    assert (tmp_path / ".deferral" / "pgdata").is_dir()


WAITS = """
from deferral import DAG, BaseOperator
from deferral.decorators import task


class Wait(BaseOperator):
    def __init__(self, key, **kwargs):
        super().__init__(**kwargs)
        self.key = key

    def execute(self, context):
        self.wait_for_signal(self.key)

    def execute_complete(self, context, event):
        return event


with DAG("embedded_waits", schedule=None):
    @task
    def got(value):
        print("got", value)

    got(Wait(task_id="answered", key="go").output)
    Wait(task_id="never", key="never-sent")
"""


def test_a_signal_is_sent_with_the_printed_command_and_ctrl_c_leaves_no_process(
    tmp_path: Path,
) -> None:
    (tmp_path / "dags").mkdir()
    (tmp_path / "dags" / "embedded_waits.py").write_text(WAITS)
    output = tmp_path / "out"
    env = {k: v for k, v in os.environ.items() if not k.startswith("DEFERRAL_")}
    with output.open("w") as out:
        proc = subprocess.Popen(
            command("deferral", "dags", "test", "embedded_waits", "--subdir", "dags"),
            cwd=tmp_path,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        line = wait_for(
            lambda: re.search(
                r"^DEFERRAL_DATABASE_URL=.* deferral signals send go$", output.read_text(), re.M
            ),
            timeout=300,
            what="the signals send line",
        ).group(0)
        # The embedded database's URL and the key's file: the line works in a bare shell.
        assert 'DEFERRAL_FERNET_KEY="$(cat ' in line
        sent = subprocess.run(
            ["bash", "-c", f"{line} --payload 42"],
            cwd=tmp_path,
            env={**env, "PATH": f"{Path(sys.executable).parent}:{env['PATH']}"},
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert sent.returncode == 0, sent.stdout + sent.stderr
        wait_for(lambda: "got | got 42" in output.read_text(), timeout=120, what="got 42")
        servers = psutil.Process(proc.pid).children(recursive=True)
        postmaster = int(
            (tmp_path / ".deferral" / "pgdata" / "postmaster.pid").read_text().split()[0]
        )
        servers.append(psutil.Process(postmaster))
        proc.send_signal(signal.SIGINT)
        assert proc.wait(120) == 130, output.read_text()
    finally:
        proc.kill()
    said = output.read_text()
    assert "stopped by SIGINT; run manual__" in said
    assert "Aborted!" not in said
    _, alive = psutil.wait_procs(servers, timeout=60)
    assert alive == []
