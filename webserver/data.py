"""What is particular to the web UI's pages of what `readmodel` reads: how big a DAG's grid is,
the graph's drawing and the trigger form's fields, and how records become JSON. Every record
itself comes from `readmodel`."""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import asdict
from typing import Any

from sqlalchemy.orm import Session

from readmodel.dags import dag_detail
from readmodel.waits import expiry_urgency
from webserver.layout import layout
from webserver.paramform import fields

__all__ = ["expiry_urgency"]  # the pages' highlighting of waits, as the read model decides it

Record = dict[str, Any]

# Runs shown by default in a DAG's grid (at most MAX_GRID_RUNS).
GRID_RUNS = 12
MAX_GRID_RUNS = 100
# A grid page shows at most this many cells (runs x tasks): a DAG of thousands of tasks is
# paged by its tasks, MAX_GRID_ROWS at most a page, fewer the more runs are shown.
MAX_GRID_CELLS = 1200
MAX_GRID_ROWS = 100
MIN_GRID_ROWS = 10
# What a DAG search may hold (a search is a substring of an id, at most 250 characters).
MAX_SEARCH_LENGTH = 250


def grid_rows(runs: int) -> int:
    """How many tasks a grid page of ``runs`` runs shows."""
    return max(MIN_GRID_ROWS, min(MAX_GRID_ROWS, MAX_GRID_CELLS // max(1, runs)))


def dag_page(
    session: Session,
    dag_id: str,
    runs: int,
    selected_run: str | None,
    task_page: int = 1,
    collapsed: Collection[str] = (),
) -> Record:
    """A DAG's grid and graph (`readmodel.dags.dag_detail`, a page of as many tasks as fit
    MAX_GRID_CELLS), with where the graph's boxes and edges are drawn and the fields of its
    trigger form."""
    record, shape = dag_detail(
        session, dag_id, runs, selected_run, grid_rows(runs), task_page, collapsed
    )
    graph = layout(shape.tasks, shape.upstream, shape.collapsed_into, shape.edge_labels)
    return {
        **record,
        "param_fields": [asdict(f) for f in fields(shape.params)],
        "graph": {**asdict(graph), **record["graph"]},
    }


def json_ready(value: Any) -> Any:
    """``value`` with mappings' keys as strings (counts keyed by state enums)."""
    if isinstance(value, Mapping):
        return {str(key): json_ready(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [json_ready(item) for item in value]
    return value
