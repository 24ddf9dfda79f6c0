"""What capturing a task's output costs the task, and how fast its lines reach Postgres.

Prints N lines (about 60 bytes each) in this process, first to /dev/null, then inside
``worker.capture.TaskOutput`` storing into a throw-away database, and reports the task's time
in both, the time to store the last batch at the end, and lines stored per second; with the
default bound per try (DEFERRAL_TASK_LOG_MAX_BYTES) or --max-bytes:

    .venv/bin/python benchmarks/task_output.py [--lines 200000] [--max-bytes 1073741824]

Uses DEFERRAL_TEST_ADMIN_URL like the tests (a local server by default).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import os
import sys
import time
import uuid
from collections.abc import Sequence

from sqlalchemy import create_engine, func, select, text
from sqlalchemy.engine import make_url

from deferral.runtime.config import DEFAULT_TASK_LOG_MAX_BYTES
from deferral.store import migrate, tasklogs, transitions
from deferral.store.db import make_engine, make_sessionmaker
from deferral.store.tables import DagRun, TaskInstance, TaskLog
from deferral.store.tasklogs import NewLine
from deferral.store.transitions import NewTaskInstance
from worker.capture import TaskOutput

ADMIN_URL = os.environ.get(
    "DEFERRAL_TEST_ADMIN_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
)


def _print_lines(count: int) -> float:
    started = time.perf_counter()
    for n in range(count):
        print(f"row {n:08d}: processed a record of the day's export, all fine")
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--lines", type=int, default=200_000)
    parser.add_argument("--max-bytes", type=int, default=DEFAULT_TASK_LOG_MAX_BYTES)
    args = parser.parse_args()
    count, max_bytes = args.lines, args.max_bytes
    name = f"deferral_bench_{uuid.uuid4().hex[:8]}"
    admin = create_engine(ADMIN_URL, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    url = make_url(ADMIN_URL).set(database=name).render_as_string(hide_password=False)
    try:
        migrate.upgrade(url)
        sessions = make_sessionmaker(make_engine(url))
        with sessions.begin() as session:
            transitions.create_dag_run(session, "bench", "r1", dt.datetime.now(dt.UTC), {})
            run = session.scalars(select(DagRun)).one()
            transitions.start_dag_run(
                session, run, [NewTaskInstance("t", 0, "default_pool", 1, "default", 1)]
            )
            session.flush()
            ti_id = session.scalars(select(TaskInstance.id)).one()

        def store(lines: Sequence[NewLine], max_bytes: int) -> None:
            with sessions.begin() as session:
                tasklogs.append(session, lines, max_bytes)

        with open(os.devnull, "w") as devnull, contextlib.redirect_stdout(devnull):
            plain = _print_lines(count)
        with TaskOutput(store) as output:
            with output.attempt(ti_id, 1, max_bytes):
                captured = _print_lines(count)
                ending = time.perf_counter()
            ended = time.perf_counter() - ending
        with sessions() as session:
            stored = session.scalar(select(func.count()).select_from(TaskLog))
        total = captured + ended  # rows stored: lines kept, and the cut marker
        print(
            f"{count} lines, bound {max_bytes} bytes: task {plain:.2f} s uncaptured,"
            f" {captured:.2f} s captured;"
            f" last batch stored {ended:.2f} s after the task; {stored} rows,"
            f" {stored / total:,.0f} lines/s end to end",
            file=sys.stderr,
        )
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


if __name__ == "__main__":
    main()
