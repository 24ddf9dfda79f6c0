"""Dynamic task mapping: a task that runs once per value, the number of values known only
when the run gets there.

``count_rows`` maps over the list ``list_files`` returns (one task instance per file, map
indexes 0..2) with an argument every map index shares (``partial``); ``total`` reduces: it gets
the list of their results, in map-index order. ``greet`` maps a BashOperator over a literal list
(each value is a template: ``{{ ti.map_index }}``), ``load`` maps over dicts of arguments
(``expand_kwargs``), and ``pause`` is a mapped deferrable sensor: each map index hands its own
wait to the triggerer.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

from deferral import dag, task
from deferral.operators import BashOperator
from deferral.sensors import TimeDeltaSensorAsync


@task
def list_files() -> list[str]:
    return ["orders.csv", "refunds.csv", "customers.csv"]


@task
def count_rows(path: str, header: bool) -> int:
    rows = len(path) * 10  # a stand-in for reading the file
    return rows - 1 if header else rows


@task
def total(counts: list[int]) -> int:
    print(f"{len(counts)} files, {sum(counts)} rows: {counts}")
    return sum(counts)


@task
def load_jobs() -> list[dict[str, Any]]:
    return [
        {"bash_command": "echo loading $TABLE", "env": {"TABLE": "orders"}},
        {"bash_command": "echo loading $TABLE", "env": {"TABLE": "refunds"}},
    ]


@dag(schedule=None)
def example_mapping() -> None:
    """Counts the rows of each file, then adds them up."""
    counts = count_rows.partial(header=True).expand(path=list_files())
    total(counts)
    BashOperator.partial(task_id="greet").expand(
        bash_command=["echo hello from {{ ti.map_index }}", "echo bonjour from {{ ti.map_index }}"]
    )
    BashOperator.partial(task_id="load").expand_kwargs(load_jobs())
    TimeDeltaSensorAsync.partial(task_id="pause", poke_interval=1).expand(
        delta=[dt.timedelta(seconds=15), dt.timedelta(seconds=20)]
    )


example_mapping()
