"""A run id with a newline and terminal escapes, written to the database by someone with access to
it (the CLI and the API refuse it): the services run it, and their logs neither gain a forged line
nor carry a raw control character; ``deferral`` shows it escaped."""

from __future__ import annotations

import datetime as dt
from pathlib import Path

import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from deferral.store import transitions
from deferral.store.tables import DagRun
from tests.e2e.conftest import Services
from tests.helpers import wait_for

pytestmark = pytest.mark.e2e

DAG = """
from deferral import DAG
from deferral.operators import EmptyOperator

with DAG("e2e_hostile") as dag:
    EmptyOperator(task_id="t")
"""

FORGED = "2026-01-01 00:00:00,000 ERROR deferral.scheduler: FORGED LINE"
RUN_ID = f"r1\n{FORGED}\x1b]0;pwned\x07\x1b[2J"


def test_a_run_id_with_a_newline_forges_no_log_line(
    services: Services, dags_folder: Path, sessions: sessionmaker[Session]
) -> None:
    (dags_folder / "e2e_hostile_dag.py").write_text(DAG)
    with sessions.begin() as session:
        transitions.create_dag_run(session, "e2e_hostile", RUN_ID, dt.datetime.now(dt.UTC), {})
    services.start("scheduler")
    services.start("worker")

    def finished() -> bool:
        with sessions() as session:
            return session.scalar(select(DagRun.state)) == "success"

    wait_for(finished, timeout=120, what="the hostile run to succeed")
    for name in ("scheduler", "worker"):
        wait_for(lambda n=name: "e2e_hostile" in services.log(n), timeout=30, what=f"{name} log")
        log = services.log(name)
        assert "FORGED LINE" in log  # the id is logged...
        for line in log.splitlines():
            assert not line.startswith(FORGED), (name, line)  # ...never as a line of its own
            assert all(ord(c) >= 0x20 or c == "\t" for c in line), (name, repr(line))
        assert r"\x1b]0;pwned\x07\x1b[2J" in log

    shown = services.run("runs", "show", "e2e_hostile", RUN_ID)
    assert shown.returncode == 0, shown.stderr
    assert "\x1b" not in shown.stdout and r"\x1b]0;pwned" in shown.stdout
