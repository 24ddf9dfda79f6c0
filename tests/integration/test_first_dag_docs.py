"""The Getting started page's "your first DAG" really runs: `deferral dags test` runs
docs/first_dag/my_first_dag.py, deferral and resumption included, and the page shows that very
file's code in a plain code block (read as raw Markdown too, not only on the site)."""

from __future__ import annotations

import os
from pathlib import Path

from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from deferral.store.tables import DagRun, TaskInstance
from tests.forks import LANE

FIRST_DAG = Path(__file__).resolve().parents[2] / "docs" / "first_dag"
TIMEOUT_SEC = 180


def test_the_first_dag_of_the_docs_runs_and_says_what_the_page_says(
    service_env: dict[str, str], sessions: sessionmaker[Session]
) -> None:
    page = (FIRST_DAG.parent / "getting-started.md").read_text()
    code = (FIRST_DAG / "my_first_dag.py").read_text()
    assert f"```python\n{code}```\n" in page
    env = {**os.environ, **service_env, "DEFERRAL_DAGS_FOLDER": str(FIRST_DAG)}
    done = LANE.run(["dags", "test", "my_first_dag"], env, TIMEOUT_SEC)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "pause: running -> deferred" in done.stdout
    assert "the answer is 42, woke at" in done.stdout
    with sessions() as session:
        run = session.scalars(select(DagRun).where(DagRun.dag_id == "my_first_dag")).one()
        states = {
            ti.task_id: ti.state
            for ti in session.scalars(
                select(TaskInstance).where(TaskInstance.dag_id == "my_first_dag")
            )
        }
    assert run.state == "success"
    assert states == {"pick_a_number": "success", "pause": "success", "report": "success"}
