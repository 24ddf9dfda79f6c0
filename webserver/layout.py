"""Where each task of a DAG's graph is drawn, and the route of each edge: a layered (Sugiyama)
layout by grandalf, left to right, so the page needs no script and no layout library of its own.

An edge that spans several layers goes through a stand-in node in each layer between (the
algorithm places those like tasks, so no box sits on them), and is drawn as the polyline through
their places: it never crosses a box that is not one of its ends. Tasks of a collapsed task group
are drawn as one box standing for the group.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from grandalf.graphs import Edge as LayoutEdge
from grandalf.graphs import Graph as LayoutGraph
from grandalf.graphs import Vertex
from grandalf.layouts import SugiyamaLayout
from grandalf.routing import route_with_lines

NODE_WIDTH = 180
NODE_HEIGHT = 34
COLUMN_GAP = 60
ROW_GAP = 16
MARGIN = 10


@dataclass(frozen=True)
class Node:
    task_id: str  # a task's id, or a collapsed group's id
    x: int
    y: int
    group: str | None = None  # set: this box stands for the collapsed group of that id
    members: int = 0  # of a collapsed group: how many tasks it holds


@dataclass(frozen=True)
class Edge:
    # From the right middle of the upstream box to the left middle of the downstream one...
    x1: int
    y1: int
    x2: int
    y2: int
    # ...through these points (each end included): the route around the boxes between.
    points: list[tuple[int, int]] = field(default_factory=list)
    # The boxes it joins (task ids, or collapsed groups' ids).
    source: str = ""
    target: str = ""


@dataclass(frozen=True)
class Graph:
    nodes: list[Node]
    edges: list[Edge]
    width: int
    height: int
    node_width: int = NODE_WIDTH
    node_height: int = NODE_HEIGHT


class _Box:
    """What grandalf lays out: laid top to bottom, so a box's width there is its height here."""

    def __init__(self) -> None:
        self.w, self.h = NODE_HEIGHT, NODE_WIDTH
        self.xy: tuple[float, float] = (0.0, 0.0)


class _Route:
    def __init__(self) -> None:
        self.points: list[tuple[float, float]] = []

    def setpath(self, points: list[tuple[float, float]]) -> None:
        self.points = points


def layout(
    order: Sequence[str],
    upstream: Mapping[str, Sequence[str]],
    collapsed: Mapping[str, str] | None = None,
) -> Graph:
    """The graph of the tasks ``order`` (upstream first, as ``DAG.topological_order`` gives
    them), ``upstream[t]`` naming the tasks ``t`` depends on; ``collapsed`` maps each task of a
    collapsed task group to the group's id (drawn as one box, its edges those of its tasks)."""
    into = dict(collapsed or {})
    boxes: list[str] = []
    members: dict[str, int] = {}
    for task_id in order:
        box = into.get(task_id, task_id)
        members[box] = members.get(box, 0) + 1
        if box not in boxes:
            boxes.append(box)
    links = sorted(
        {
            (into.get(up, up), into.get(task_id, task_id))
            for task_id in order
            for up in upstream.get(task_id, ())
            if up in members or into.get(up) in members
        }
        - {(box, box) for box in boxes}
    )
    if not boxes:
        return Graph(nodes=[], edges=[], width=0, height=0)
    vertices = {box: Vertex(box) for box in boxes}
    for vertex in vertices.values():
        vertex.view = _Box()
    edges = []
    for up, down in links:
        edge = LayoutEdge(vertices[up], vertices[down])
        edge.view = _Route()
        edges.append(edge)
    laid = LayoutGraph(list(vertices.values()), edges)
    for component in laid.C:
        sugiyama = SugiyamaLayout(component)
        sugiyama.xspace, sugiyama.yspace = ROW_GAP, COLUMN_GAP
        sugiyama.route_edge = route_with_lines
        sugiyama.init_all(optimize=True)
        sugiyama.draw(3)
    # Components side by side in grandalf's space overlap: stack them top to bottom here.
    centres: dict[str, tuple[float, float]] = {}
    routes: dict[tuple[str, str], list[tuple[float, float]]] = {}
    top = 0.0
    for component in laid.C:
        xs = [v.view.xy[0] for v in component.sV]
        ys = [v.view.xy[1] for v in component.sV]
        left, low = min(xs) - NODE_HEIGHT / 2, min(ys) - NODE_WIDTH / 2

        def place(
            x: float, y: float, low: float = low, left: float = left, top: float = top
        ) -> tuple[float, float]:
            return (y - low, x - left + top)

        for vertex in component.sV:
            centres[vertex.data] = place(*vertex.view.xy)
        for edge in component.sE:
            ends = (edge.v[0].data, edge.v[1].data)
            routes[ends] = [place(x, y) for x, y in edge.view.points]
        top += max(xs) - min(xs) + NODE_HEIGHT + ROW_GAP
    nodes = {
        box: Node(
            box,
            MARGIN + round(cx - NODE_WIDTH / 2),
            MARGIN + round(cy - NODE_HEIGHT / 2),
            group=box if box not in order else None,
            members=members[box] if box not in order else 0,
        )
        for box, (cx, cy) in centres.items()
    }
    drawn = []
    for up, down in links:
        start = (nodes[up].x + NODE_WIDTH, nodes[up].y + NODE_HEIGHT // 2)
        end = (nodes[down].x, nodes[down].y + NODE_HEIGHT // 2)
        # grandalf's route starts and ends on the boxes' borders; between, one point per layer
        # crossed (its stand-in's place), which the edge crosses level, as wide as a box: it
        # bends only in the gaps between layers, where no box stands.
        middle = [
            (MARGIN + round(x) + side, MARGIN + round(y))
            for x, y in routes[(up, down)][1:-1]
            for side in (-NODE_WIDTH // 2, NODE_WIDTH // 2)
        ]
        drawn.append(Edge(*start, *end, points=[start, *middle, end], source=up, target=down))
    width = max(node.x for node in nodes.values()) + NODE_WIDTH + MARGIN
    height = max(node.y for node in nodes.values()) + NODE_HEIGHT + MARGIN
    return Graph(nodes=[nodes[box] for box in boxes], edges=drawn, width=width, height=height)
