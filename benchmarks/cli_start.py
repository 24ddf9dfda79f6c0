"""How long the ``deferral`` command takes to start: ``--version``, ``--help``, and ``dags list``
with no DAG file (the command's own cost: start, imports, settings, one query) and with the
example DAGs (plus loading them, its work).

    .venv/bin/python benchmarks/cli_start.py [--runs 3]

Each command runs ``--runs`` times as a fresh process of the installed console script, against
a fresh migrated database (no service is started); the figures are the median and the slowest
wall-clock time of each.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import tempfile
import time
from pathlib import Path

from harness import BIN, Figure, Stack, median, report

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def timed(args: list[str], env: dict[str, str], runs: int) -> list[float]:
    """Wall-clock seconds of ``deferral <args>``, ``runs`` times."""
    seconds = []
    for _ in range(runs):
        started = time.perf_counter()
        subprocess.run([str(BIN / "deferral"), *args], env=env, check=True, capture_output=True)
        seconds.append(time.perf_counter() - started)
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    runs = parser.parse_args().runs
    with Stack() as stack, tempfile.TemporaryDirectory() as empty:
        bare = {**stack.env, "DEFERRAL_DAGS_FOLDER": empty}
        examples = {**stack.env, "DEFERRAL_DAGS_FOLDER": str(EXAMPLES)}
        measured = {
            "deferral --version": (timed(["--version"], bare, runs), 300),
            "deferral --help": (timed(["--help"], bare, runs), 300),
            "deferral dags list, no DAG file": (timed(["dags", "list"], bare, runs), 800),
            "deferral dags list, the examples": (timed(["dags", "list"], examples, runs), None),
        }
    figures = []
    for label, (seconds, target) in measured.items():
        figures.append(Figure(f"{label}, median", median(seconds) * 1000, "ms", target))
        figures.append(Figure(f"{label}, slowest", max(seconds) * 1000, "ms"))
    shown = ", ".join(
        f"{label} {' / '.join(f'{s:.2f}' for s in seconds)} s"
        for label, (seconds, _) in measured.items()
    )
    report(
        f"deferral command start ({runs} runs each, {os.cpu_count()} cores)",
        figures,
        [f"each run: {shown}"],
    )


if __name__ == "__main__":
    main()
