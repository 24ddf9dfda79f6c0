"""`deferral dags test example_deferrable` with nothing configured and no service running: the
run goes to an embedded PostgreSQL (standalone mode's), the deferral's trigger runs in the
command's own process, and it exits 0."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tests.e2e.conftest import command
from tests.helpers import wait_for

pytestmark = pytest.mark.e2e

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def test_dags_test_runs_the_deferrable_example_on_an_embedded_database(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DEFERRAL_")}
    done = subprocess.run(
        command("deferral", "dags", "test", "example_deferrable", "--subdir", str(EXAMPLES)),
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "DEFERRAL_DATABASE_URL is not set: using an embedded PostgreSQL" in done.stderr
    assert "wait: running -> deferred (deferred to trigger" in done.stdout
    assert "wait: deferred -> scheduled (trigger" in done.stdout
    assert "report | the wait took" in done.stdout
    assert done.stdout.rstrip().endswith(": success")
    assert (tmp_path / ".deferral" / "pgdata").is_dir()
    # The run is kept there: a second test of the DAG is a second run beside it (once the
    # first command's server has finished stopping).
    pid_file = tmp_path / ".deferral" / "pgdata" / "postmaster.pid"
    wait_for(lambda: not pid_file.exists(), timeout=60, what="the embedded server to stop")
    again = subprocess.run(
        command("deferral", "dags", "test", "example_deferrable", "-S", str(EXAMPLES)),
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
