"""`deferral dags test example_deferrable` with nothing configured and no service running: the
run goes to an embedded PostgreSQL (standalone mode's), the deferral's trigger runs in the
command's own process, and it exits 0."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tests.e2e.conftest import command

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
