"""Where each task of a DAG's graph is drawn: pure geometry, so the page needs no script and no
layout library. Tasks stand in columns by their depth (the longest path from a root), upstream
on the left; within a column, in the order of the tasks they hang from."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

NODE_WIDTH = 180
NODE_HEIGHT = 34
COLUMN_GAP = 60
ROW_GAP = 16
MARGIN = 10


@dataclass(frozen=True)
class Node:
    task_id: str
    x: int
    y: int


@dataclass(frozen=True)
class Edge:
    # From the right middle of the upstream node to the left middle of the downstream one.
    x1: int
    y1: int
    x2: int
    y2: int


@dataclass(frozen=True)
class Graph:
    nodes: list[Node]
    edges: list[Edge]
    width: int
    height: int
    node_width: int = NODE_WIDTH
    node_height: int = NODE_HEIGHT


def layout(order: Sequence[str], upstream: Mapping[str, Sequence[str]]) -> Graph:
    """The graph of the tasks ``order`` (upstream first, as ``DAG.topological_order`` gives
    them), ``upstream[t]`` naming the tasks ``t`` depends on."""
    depth: dict[str, int] = {}
    for task_id in order:
        depth[task_id] = 1 + max((depth[up] for up in upstream.get(task_id, ())), default=-1)
    columns: dict[int, list[str]] = {}
    row_of: dict[str, float] = {}
    for task_id in order:
        column = columns.setdefault(depth[task_id], [])
        column.append(task_id)
    for level in sorted(columns):
        # Below the tasks it hangs from (the mean of their rows), ties in topological order.
        placed = sorted(
            columns[level],
            key=lambda t: _mean([row_of[up] for up in upstream.get(t, ())], default=0.0),
        )
        columns[level] = placed
        for row, task_id in enumerate(placed):
            row_of[task_id] = row
    nodes = {
        task_id: Node(
            task_id,
            MARGIN + depth[task_id] * (NODE_WIDTH + COLUMN_GAP),
            MARGIN + int(row_of[task_id]) * (NODE_HEIGHT + ROW_GAP),
        )
        for task_id in order
    }
    edges = [
        Edge(
            nodes[up].x + NODE_WIDTH,
            nodes[up].y + NODE_HEIGHT // 2,
            nodes[task_id].x,
            nodes[task_id].y + NODE_HEIGHT // 2,
        )
        for task_id in order
        for up in sorted(upstream.get(task_id, ()))
        if up in nodes
    ]
    widest = max((len(column) for column in columns.values()), default=0)
    return Graph(
        nodes=[nodes[task_id] for task_id in order],
        edges=edges,
        width=2 * MARGIN + len(columns) * (NODE_WIDTH + COLUMN_GAP) - COLUMN_GAP * bool(columns),
        height=2 * MARGIN + widest * (NODE_HEIGHT + ROW_GAP) - ROW_GAP * bool(columns),
    )


def _mean(values: Sequence[float], default: float) -> float:
    return sum(values) / len(values) if values else default
