"""The first page of the lists with many rows waiting (issue 30): the Deferred page and its API,
``deferral tasks list --state deferred``, ``triggers list`` and the read model's functions
behind them, with ``--n`` task instances deferred, each on a trigger of its own with its state
change recorded.

    .venv/bin/python benchmarks/readmodel_pages.py [--n 1000000] [--runs 5]

No service runs: the rows are written by SQL (a million in about a minute), then VACUUM ANALYZE.
Each figure is the median and the slowest of ``--runs`` reads; the CLI's include the process's
start (see ``cli_start.py`` for that alone).
"""

from __future__ import annotations

import argparse
import subprocess
import time
from collections.abc import Callable
from typing import Any

from harness import BIN, Figure, Stack, median, report
from sqlalchemy import text
from starlette.testclient import TestClient

from deferral.runtime.config import load_settings
from readmodel.tasks import task_list
from readmodel.triggers import trigger_list
from readmodel.waits import deferred_now
from webserver.app import create_app

CHUNK = 100_000
TRIGGER = "deferral.triggers.temporal.DateTimeTrigger"


def seed(stack: Stack, n: int) -> None:
    """``n`` task instances deferred on a trigger each, with their state change to deferred."""
    for start in range(0, n, CHUNK):
        with stack.sessions.begin() as session:
            session.execute(
                text(
                    "WITH made AS (INSERT INTO trigger (classpath, kwargs)"
                    " SELECT :classpath, 'sealed' FROM generate_series(1, :n) RETURNING id),"
                    " tis AS (INSERT INTO task_instance (dag_id, run_id, task_id, state,"
                    " try_number, trigger_id) SELECT 'waiting', 'r' || (id / 1000), 't' || id,"
                    " 'deferred', 1, id FROM made RETURNING id)"
                    " INSERT INTO task_state_change (task_instance_id, from_state, to_state,"
                    " reason) SELECT id, 'running', 'deferred', 'deferred' FROM tis"
                ),
                {"classpath": TRIGGER, "n": min(CHUNK, n - start)},
            )


def timed(read: Callable[[], Any], runs: int) -> list[float]:
    seconds = []
    for _ in range(runs):
        started = time.perf_counter()
        read()
        seconds.append(time.perf_counter() - started)
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=1_000_000)
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    with Stack() as stack:
        started = time.perf_counter()
        seed(stack, args.n)
        stack.vacuum_analyze()
        seeded_sec = time.perf_counter() - started
        settings = load_settings(stack.env)

        def in_process(read: Callable[[Any], Any]) -> Callable[[], Any]:
            def call() -> Any:
                with stack.sessions() as session:
                    return read(session)

            return call

        def cli(*command: str) -> Callable[[], Any]:
            return lambda: subprocess.run(
                [str(BIN / "deferral"), *command], env=stack.env, check=True, capture_output=True
            )

        app = create_app(settings, host="127.0.0.1", environ=stack.env)
        with TestClient(app, base_url="http://localhost") as client:
            first = client.get("/api/v1/deferred").json()
            assert first["listed"] == min(args.n, 500)
            assert first["total_capped"] == (args.n > 10_000)
            measured = {
                "Deferred page (HTML)": (
                    timed(lambda: client.get("/deferred").raise_for_status(), args.runs),
                    1000,
                ),
                "GET /api/v1/deferred": (
                    timed(lambda: client.get("/api/v1/deferred").raise_for_status(), args.runs),
                    1000,
                ),
                "deferral tasks list --state deferred": (
                    timed(cli("tasks", "list", "--state", "deferred"), args.runs),
                    1000,
                ),
                "deferral triggers list": (timed(cli("triggers", "list"), args.runs), None),
                "readmodel.waits.deferred_now, 500": (
                    timed(in_process(lambda s: deferred_now(s, settings, limit=500)), args.runs),
                    None,
                ),
                "readmodel.tasks.task_list, deferred, 100": (
                    timed(
                        in_process(lambda s: task_list(s, limit=100, state="deferred")), args.runs
                    ),
                    None,
                ),
                "readmodel.triggers.trigger_list, 100": (
                    timed(in_process(lambda s: trigger_list(s, limit=100)), args.runs),
                    None,
                ),
            }
    figures = []
    for label, (seconds, target) in measured.items():
        figures.append(Figure(f"{label}, median", median(seconds) * 1000, "ms", target))
        figures.append(Figure(f"{label}, slowest", max(seconds) * 1000, "ms"))
    report(
        f"First pages with {args.n:,} task instances deferred ({args.runs} reads each)",
        figures,
        [f"seeded and analyzed in {seeded_sec:.0f} s"],
    )


if __name__ == "__main__":
    main()
