"""`deferral tasks explain` shows a task's documentation and its DAG's."""

from __future__ import annotations

import datetime as dt
import uuid
from collections.abc import Callable
from pathlib import Path

from click.testing import CliRunner
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from deferral.runtime.config import Settings
from deferral.store import transitions
from deferral.store.tables import DagRun
from deferral.store.transitions import NewTaskInstance
from deferral_cli import main as deferral_main
from tests.parsed_dags import record_dags_folder

DAG_SOURCE = '''
from deferral import DAG, task
from deferral.operators import EmptyOperator

with DAG("{dag_id}", doc_md="{dag_doc}"):
    EmptyOperator(task_id="documented", doc_md="# Loads\\n\\nthe **table**.", doc_rst="rst text")
    EmptyOperator(task_id="plain")

    @task
    def taskflow():
        """From the docstring."""

    taskflow()
'''


def _explain(dag_id: str, task_id: str) -> list[str]:
    result = CliRunner().invoke(deferral_main, ["tasks", "explain", dag_id, "r1", task_id])
    assert result.exit_code == 0, result.output
    return result.output.splitlines()


def _dag_with_run(
    settings: Settings,
    sessions: sessionmaker[Session],
    write_dag: Callable[[str, str], Path],
    dag_doc: str,
) -> str:
    dag_id = f"docs_{uuid.uuid4().hex[:8]}"
    write_dag(dag_id, DAG_SOURCE.format(dag_id=dag_id, dag_doc=dag_doc))
    record_dags_folder(settings)
    with sessions.begin() as session:
        transitions.create_dag_run(session, dag_id, "r1", dt.datetime.now(dt.UTC), {})
        run = session.scalars(select(DagRun)).one()
        transitions.start_dag_run(
            session,
            run,
            [
                NewTaskInstance(t, 0, "default_pool", 1, "default", 1)
                for t in ("documented", "plain", "taskflow")
            ],
        )
    return dag_id


def test_explain_shows_the_task_docs_then_the_dag_doc(
    settings: Settings, sessions: sessionmaker[Session], write_dag: Callable[[str, str], Path]
) -> None:
    dag_id = _dag_with_run(settings, sessions, write_dag, "Daily load of the table.")
    lines = _explain(dag_id, "documented")
    docs = lines[lines.index("  task doc_md:") :]
    assert docs == [
        "  task doc_md:",
        "    # Loads",
        "",
        "    the **table**.",
        "  task doc_rst:",
        "    rst text",
        "  DAG doc_md:",
        "    Daily load of the table.",
    ]
    assert _explain(dag_id, "taskflow")[-4:-2] == ["  task doc_md:", "    From the docstring."]
    plain = _explain(dag_id, "plain")
    assert "  task doc_md:" not in plain and plain[-2:] == [
        "  DAG doc_md:",
        "    Daily load of the table.",
    ]


def test_a_dag_doc_md_naming_a_markdown_file_next_to_the_dag_shows_the_file(
    settings: Settings,
    sessions: sessionmaker[Session],
    write_dag: Callable[[str, str], Path],
    dags_folder: Path,
) -> None:
    (dags_folder / "README_dag.md").write_text("From the file.\nSecond line.\n")
    dag_id = _dag_with_run(settings, sessions, write_dag, "README_dag.md")
    assert _explain(dag_id, "plain")[-3:] == [
        "  DAG doc_md:",
        "    From the file.",
        "    Second line.",
    ]
