"""A DAG of 5,000 tasks and 12 runs (60,000 task instances, one task mapped 2,000 ways, runs
with a large conf) on the web UI: the page is paged by tasks, small and quick, and reads no
run's conf."""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import event, insert, text
from sqlalchemy.engine import Engine
from sqlalchemy.orm import Session, sessionmaker
from starlette.testclient import TestClient

from broker.client import Broker
from deferral.runtime.config import Settings
from deferral.store.tables import DagRun
from tests.integration.conftest import web_client
from webserver import data

BIG_DAG = "big_dag"
TASKS = 5000
RUNS = 12
MAPPED = 2000
BIG_DAG_SOURCE = f"""
from deferral import DAG
from deferral.operators import EmptyOperator

with DAG("{BIG_DAG}") as dag:
    previous = None
    for n in range({TASKS}):
        task = EmptyOperator(task_id=f"t{{n:04d}}")
        # Chains of 50: the order is topological, and not trivially one line.
        if previous is not None and n % 50:
            previous >> task
        previous = task
"""


@pytest.fixture
def big_dag(write_dag: Callable[[str, str], Path], sessions: sessionmaker[Session]) -> str:
    write_dag(BIG_DAG, BIG_DAG_SOURCE)
    start = dt.datetime(2024, 1, 1, tzinfo=dt.UTC)
    big_conf = {"blob": "x" * 200_000}
    with sessions.begin() as session:
        session.execute(
            insert(DagRun),
            [
                {
                    "dag_id": BIG_DAG,
                    "run_id": f"run{n:02d}",
                    "logical_date": start + dt.timedelta(days=n),
                    "state": "success",
                    "conf": big_conf,
                }
                for n in range(RUNS)
            ],
        )
        session.execute(
            text(
                "INSERT INTO task_instance (dag_id, run_id, task_id, state, try_number)"
                " SELECT r.dag_id, r.run_id, 't' || lpad(g::text, 4, '0'), 'success', 1"
                " FROM dag_run r, generate_series(1, :tasks - 1) g WHERE r.dag_id = :dag"
            ),
            {"dag": BIG_DAG, "tasks": TASKS},
        )
        # t0000 is mapped 2,000 ways in every run, one map index still running in the last.
        session.execute(
            text(
                "INSERT INTO task_instance (dag_id, run_id, task_id, map_index, state, try_number)"
                " SELECT r.dag_id, r.run_id, 't0000', g,"
                " CASE WHEN r.run_id = :last AND g = 7 THEN 'running' ELSE 'success' END, 1"
                " FROM dag_run r, generate_series(0, :mapped - 1) g WHERE r.dag_id = :dag"
            ),
            {"dag": BIG_DAG, "mapped": MAPPED, "last": f"run{RUNS - 1:02d}"},
        )
    return BIG_DAG


class _Reads:
    """The statements a client's requests run, and the rows each returned."""

    def __init__(self, engine: Engine) -> None:
        self.done: list[tuple[str, int]] = []
        event.listen(engine, "after_cursor_execute", self._record)

    def _record(self, conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        self.done.append((statement, cursor.rowcount))

    def of(self, client: TestClient, path: str) -> tuple[Any, list[tuple[str, int]]]:
        """The answer to ``path`` and the statements it ran."""
        before = len(self.done)
        answer = client.get(path)
        return answer, self.done[before:]


def test_a_5000_task_dag_page_is_paged_small_quick_and_reads_no_conf(
    settings: Settings, sessions: sessionmaker[Session], broker: Broker, big_dag: str
) -> None:
    with web_client(settings, "127.0.0.1") as client:
        reads = _Reads(client.app.state.ui.sessions.kw["bind"])  # type: ignore[attr-defined]
        # The first request imports the 5,000-task file (the DagBag keeps it afterwards).
        assert client.get(f"/dags/{BIG_DAG}").status_code == 200
        page, statements = reads.of(client, f"/dags/{BIG_DAG}")
        assert page.status_code == 200
        assert len(page.content) < 1_000_000, len(page.content)
        # Quick by its work, not a stopwatch a loaded machine breaks: a few statements, reading
        # the task list and one page of cells, not the DAG's tens of thousands of task instances.
        assert len(statements) <= 6, [s[:80] for s, _ in statements]
        rows_read = sum(max(0, rows) for _, rows in statements)
        assert rows_read <= TASKS + 2 * data.MAX_GRID_CELLS, rows_read
        rows = data.grid_rows(data.GRID_RUNS)
        assert page.text.count('<tr data-task="') == rows
        assert f"Tasks 1 to {rows} of {TASKS}" in page.text
        assert 'id="graph-too-big"' in page.text
        # The mapped task is one row, its 2,000 map indexes counted.
        assert 'data-task="t0000" data-run="run11" data-state="running"' in page.text
        assert "1 running, 1999 success" in page.text
        assert not [s for s, _ in reads.done if "dag_run.conf" in s]

        last = -(-TASKS // rows)
        final = client.get(f"/dags/{BIG_DAG}?task_page={last}")
        assert final.status_code == 200 and 'data-task="t4999"' in final.text
        assert client.get(f"/dags/{BIG_DAG}?task_page={last + 1}").status_code == 404

        api = client.get(f"/api/v1/dags/{BIG_DAG}?runs=100")
        assert api.status_code == 200 and len(api.content) < 1_000_000
        grid = api.json()
        assert len(grid["tasks"]) * len(grid["runs"]) <= data.MAX_GRID_CELLS
        assert grid["task_count"] == TASKS and grid["graph"]["drawn"] is False
