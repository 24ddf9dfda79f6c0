"""The README's demo: `deferral standalone` with nothing configured starts embedded PostgreSQL and
Redis, runs the example DAG through all three services, and stops everything."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tests.e2e.conftest import command

pytestmark = pytest.mark.e2e

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def test_standalone_runs_the_example_on_embedded_servers(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DEFERRAL_")}
    done = subprocess.run(
        command(
            "deferral",
            "standalone",
            "--dags-folder",
            str(EXAMPLES),
            "--run",
            "example_deferrable",
            "--timeout",
            "120",
        ),
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "example_deferrable manual__" in done.stdout
    assert "  wait: success (try 1)" in done.stdout
    assert "running -> deferred (deferred to trigger" in done.stdout
    assert "  report: success (try 1)" in done.stdout
    # Embedded servers: the data and the key live in the working directory.
    assert (tmp_path / ".deferral" / "pgdata").is_dir()
    assert (tmp_path / ".deferral" / "fernet.key").is_file()
