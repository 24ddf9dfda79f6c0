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

from deferral.loading.dagbag import DagBag
from deferral.loading.parsing import FolderParser
from deferral.runtime.config import load_settings
from deferral.store.db import make_engine, make_sessionmaker
from scheduler import dags

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def timed(args: list[str], env: dict[str, str], runs: int) -> list[float]:
    """Wall-clock seconds of ``deferral <args>``, ``runs`` times."""
    seconds = []
    for _ in range(runs):
        started = time.perf_counter()
        subprocess.run([str(BIN / "deferral"), *args], env=env, check=True, capture_output=True)
        seconds.append(time.perf_counter() - started)
    return seconds


def record_parse(env: dict[str, str]) -> None:
    """What a scheduler records of the DAGs folder of ``env`` (the display commands read only
    that: readmodel/DECISIONS.md 5), its own parser and writer."""
    settings = load_settings(env, toml_path=Path("/nonexistent"))
    parser = FolderParser(DagBag(settings.dags_folder), settings.dagbag_import_timeout)
    engine = make_engine(settings.database_url)
    try:
        with make_sessionmaker(engine).begin() as session:
            dags.record(session, str(settings.dags_folder), parser.parse())
    finally:
        parser.close()
        engine.dispose()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    runs = parser.parse_args().runs
    with Stack() as stack, tempfile.TemporaryDirectory() as empty:
        bare = {**stack.env, "DEFERRAL_DAGS_FOLDER": empty}
        examples = {**stack.env, "DEFERRAL_DAGS_FOLDER": str(EXAMPLES)}
        record_parse(bare)
        measured = {
            "deferral --version": (timed(["--version"], bare, runs), 300),
            "deferral --help": (timed(["--help"], bare, runs), 300),
            "deferral dags list, no DAG file": (timed(["dags", "list"], bare, runs), 800),
        }
        record_parse(examples)
        measured["deferral dags list, the examples"] = (
            timed(["dags", "list"], examples, runs),
            None,
        )
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
