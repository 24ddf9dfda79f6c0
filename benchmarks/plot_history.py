"""Draw benchmarks/history.jsonl for the docs site: one panel per benchmark with two sittings or
more that recorded figures, each figure a line over its sittings, labelled by date and commit.

    .venv/bin/pip install -e '.[bench]' && .venv/bin/python benchmarks/plot_history.py

Writes docs/img/benchmarks.png (committed: the docs build and the tests need no matplotlib).
Each line of the history is one sitting: ``benchmark``, ``date`` and ``time_utc``, ``commit``,
``load_average``, ``calibration`` (null before the benchmarks printed one), ``figures`` (name ->
number), ``command``, ``title`` and ``text`` (what was measured, as written down then).
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt

HERE = Path(__file__).resolve().parent
HISTORY = HERE / "history.jsonl"
PNG = HERE.parent / "docs" / "img" / "benchmarks.png"


def read(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def when(sitting: dict[str, Any]) -> tuple[str, str]:
    return sitting["date"], sitting["time_utc"] or ""


def panels(sittings: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """Each benchmark's dated sittings with figures, if two or more."""
    by_benchmark: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for sitting in sittings:
        if sitting["date"] and sitting["figures"]:
            by_benchmark[sitting["benchmark"]].append(sitting)
    return {name: sorted(kept, key=when) for name, kept in by_benchmark.items() if len(kept) > 1}


def plot(sittings: list[dict[str, Any]], out: Path) -> None:
    shown = panels(sittings)
    figure, axes = plt.subplots(len(shown), 1, figsize=(9, 3.4 * len(shown)), squeeze=False)
    for axis, (name, kept) in zip(axes[:, 0], shown.items(), strict=True):
        # One step per sitting, in order: sittings come hours or weeks apart.
        for figure_name in sorted({key for sitting in kept for key in sitting["figures"]}):
            points = [
                (position, sitting["figures"][figure_name])
                for position, sitting in enumerate(kept)
                # A number: a few figures are lists or tables (per tenth, per table).
                if isinstance(sitting["figures"].get(figure_name), int | float)
            ]
            if not points:
                continue
            label = figure_name.replace("_", " ")
            axis.plot(*zip(*points, strict=True), marker="o", label=label)
        axis.set_xticks(range(len(kept)))
        axis.set_xticklabels(
            [f"{s['date'][5:]} {s['time_utc'] or ''}\n{s['commit'] or ''}" for s in kept],
            fontsize=7,
        )
        axis.set_title(f"{name}: {kept[-1]['title']}"[:110], fontsize=9)
        axis.set_ylim(bottom=0)
        axis.grid(alpha=0.3)
        axis.legend(fontsize=7, loc="best")
        axis.tick_params(axis="y", labelsize=8)
    figure.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out, dpi=90)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--history", type=Path, default=HISTORY)
    parser.add_argument("--out", type=Path, default=PNG)
    args = parser.parse_args()
    plot(read(args.history), args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
