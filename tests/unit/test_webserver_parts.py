"""The web UI's pure parts: graph layout, expiry highlighting, who counts as local, where a
login may send the browser back to, and the session key."""

from __future__ import annotations

import base64
import datetime as dt
import itertools
import random
import re
from pathlib import Path

import pytest
from cryptography.fernet import Fernet

from deferral.runtime.config import Settings, load_settings
from deferral.states import TaskState
from webserver.app import _duration, _safe_next, dag_url, ti_url
from webserver.auth import is_loopback, session_key
from webserver.data import expiry_urgency
from webserver.layout import COLUMN_GAP, NODE_HEIGHT, NODE_WIDTH, ROW_GAP, Graph, layout


def test_layout_puts_each_task_right_of_everything_it_depends_on() -> None:
    #   a -> b -> d
    #   a -> c -> d ; e alone
    upstream = {"b": ["a"], "c": ["a"], "d": ["b", "c"]}
    graph = layout(["a", "e", "b", "c", "d"], upstream)
    at = {node.task_id: (node.x, node.y) for node in graph.nodes}
    column = NODE_WIDTH + COLUMN_GAP
    assert at["a"][0] == at["e"][0] < at["b"][0] == at["c"][0] < at["d"][0]
    assert at["b"][0] - at["a"][0] == column
    assert abs(at["c"][1] - at["b"][1]) == NODE_HEIGHT + ROW_GAP
    assert len(graph.edges) == 4
    d_edges = [e for e in graph.edges if e.x2 == at["d"][0]]
    assert len(d_edges) == 2 and all(e.x1 == at["b"][0] + NODE_WIDTH for e in d_edges)
    assert graph.width == 2 * 10 + 3 * column - COLUMN_GAP
    assert layout([], {}).nodes == []


def _segment_enters(p: tuple[int, int], q: tuple[int, int], box: tuple[int, int, int, int]) -> bool:
    """Whether the segment p-q passes through the inside of box (left, top, right, bottom)."""
    left, top, right, bottom = box
    steps = 200
    for i in range(steps + 1):
        x = p[0] + (q[0] - p[0]) * i / steps
        y = p[1] + (q[1] - p[1]) * i / steps
        if left < x < right and top < y < bottom:
            return True
    return False


def _crossings(graph: Graph) -> list[tuple[str, str, str]]:
    """(edge's upstream, downstream, box it passes through) for every edge through a box that
    is not one of its ends."""
    boxes = {n.task_id: (n.x, n.y, n.x + NODE_WIDTH, n.y + NODE_HEIGHT) for n in graph.nodes}
    at_start = {(n.x + NODE_WIDTH, n.y + NODE_HEIGHT // 2): n.task_id for n in graph.nodes}
    at_end = {(n.x, n.y + NODE_HEIGHT // 2): n.task_id for n in graph.nodes}
    found = []
    for edge in graph.edges:
        up, down = at_start[(edge.x1, edge.y1)], at_end[(edge.x2, edge.y2)]
        assert edge.points[0] == (edge.x1, edge.y1) and edge.points[-1] == (edge.x2, edge.y2)
        for name, box in boxes.items():
            if name in (up, down):
                continue
            if any(_segment_enters(p, q, box) for p, q in itertools.pairwise(edge.points)):
                found.append((up, down, name))
    return found


def test_an_edge_that_skips_layers_goes_around_the_boxes_between() -> None:
    # summarize -> join skips choose and big_day: drawn straight, it read as passing through.
    upstream = {
        "choose": ["summarize"],
        "big_day": ["choose"],
        "small_day": ["choose"],
        "join": ["big_day", "small_day", "summarize"],
    }
    graph = layout(["summarize", "choose", "big_day", "small_day", "join"], upstream)
    assert _crossings(graph) == []
    long_edge = next(e for e in graph.edges if len(e.points) > 2)
    assert len(long_edge.points) == 6  # bent only in the gaps: level through two layers


@pytest.mark.parametrize("seed", range(20))
def test_no_edge_of_a_random_dag_passes_through_a_box(seed: int) -> None:
    rng = random.Random(seed)
    order = [f"t{i}" for i in range(30)]
    upstream = {
        task: rng.sample(order[:i], k=min(i, rng.randint(0, 3))) for i, task in enumerate(order)
    }
    graph = layout(order, upstream)
    assert _crossings(graph) == []
    assert {n.task_id for n in graph.nodes} == set(order)
    assert all(n.x >= 0 and n.x + NODE_WIDTH <= graph.width for n in graph.nodes)
    assert all(n.y >= 0 and n.y + NODE_HEIGHT <= graph.height for n in graph.nodes)


def test_a_collapsed_group_is_one_box_with_its_tasks_edges() -> None:
    upstream = {"g.b": ["a"], "g.c": ["g.b"], "d": ["g.c"]}
    graph = layout(["a", "g.b", "g.c", "d"], upstream, collapsed={"g.b": "g", "g.c": "g"})
    assert [(n.task_id, n.group, n.members) for n in graph.nodes] == [
        ("a", None, 0),
        ("g", "g", 2),
        ("d", None, 0),
    ]
    assert len(graph.edges) == 2  # a -> g -> d: the edge inside the group is not drawn


def test_expiry_is_soon_in_the_last_fifth_of_a_wait_capped_at_five_minutes() -> None:
    now = dt.datetime(2024, 1, 1, 12, tzinfo=dt.UTC)
    minutes = dt.timedelta(minutes=1)
    assert expiry_urgency(now - 8 * minutes, now + 2 * minutes, now) == "soon"
    assert expiry_urgency(now - 7 * minutes, now + 3 * minutes, now) is None
    assert expiry_urgency(now - 600 * minutes, now + 6 * minutes, now) is None  # cap: 5 min
    assert expiry_urgency(now - 600 * minutes, now + 4 * minutes, now) == "soon"
    assert expiry_urgency(now - minutes, now - dt.timedelta(seconds=1), now) == "expired"
    assert expiry_urgency(now - minutes, None, now) is None


@pytest.mark.parametrize(
    ("host", "local"),
    [
        ("127.0.0.1", True),
        ("127.0.0.2", True),
        ("::1", True),
        ("localhost", True),
        ("0.0.0.0", False),
        ("::", False),
        ("192.168.1.4", False),
        ("example.org", False),
    ],
)
def test_only_loopback_addresses_open_pages_without_login(host: str, local: bool) -> None:
    assert is_loopback(host) is local


@pytest.mark.parametrize(
    ("target", "went"),
    [
        ("/dags/x?run_id=1", "/dags/x?run_id=1"),
        ("//evil.example/", "/dags"),
        ("/\\evil.example", "/dags"),
        ("https://evil.example/", "/dags"),
        (None, "/dags"),
    ],
)
def test_a_login_sends_back_only_to_a_path_of_this_site(target: object, went: str) -> None:
    assert _safe_next(target) == went


def test_urls_quote_ids_whatever_they_hold() -> None:
    assert dag_url("d", run_id="a b&c") == "/dags/d?run_id=a+b%26c"
    assert (
        ti_url("d", "<r>", "t", 2) == "/dags/d/task_instance?run_id=%3Cr%3E&task_id=t&map_index=2"
    )
    assert ti_url("d", "r", "t", -1) == "/dags/d/task_instance?run_id=r&task_id=t"


def test_durations_read_well() -> None:
    assert [_duration(s) for s in (None, 3.25, 75, 3700, 200000)] == [
        "-",
        "3.2s",
        "1m 15s",
        "1h 01m",
        "2d 07h",
    ]


def test_the_session_key_is_derived_from_the_first_fernet_key_and_is_not_it() -> None:
    first, second = Fernet.generate_key().decode(), Fernet.generate_key().decode()

    def settings(keys: str) -> Settings:
        return load_settings(
            {
                "DEFERRAL_DATABASE_URL": "postgresql://u@h/d",
                "DEFERRAL_REDIS_URL": "redis://h",
                "DEFERRAL_FERNET_KEY": keys,
            },
            toml_path=Path("/nonexistent"),
        )

    key = session_key(settings(f"{first},{second}"))
    assert key == session_key(settings(first)) != session_key(settings(second))
    assert key != base64.urlsafe_b64decode(first) and len(key) == 32


def test_the_legend_and_the_graph_colour_every_task_state() -> None:
    web = Path(__file__).resolve().parents[2] / "webserver"
    legend = re.search(
        r'class="legend">\{% for s in \[([^\]]*)\]', (web / "templates/dag.html").read_text()
    )
    assert legend is not None
    assert [s.strip(' "') for s in legend.group(1).split(",")] == [
        "none", "scheduled", "queued", "running", "deferred", "awaiting_input",
        "up_for_reschedule", "up_for_retry", "success", "failed", "upstream_failed", "skipped",
        "removed",
    ]  # fmt: skip
    css = (web / "static/deferral.css").read_text()
    for state in TaskState:
        assert f".s-{state} {{" in css, state
        if state != TaskState.NONE:  # a box with no state is drawn white
            assert f"svg.graph .g-{state} rect {{" in css, state
    # Glyphs from the text fonts: an emoji needs a font the machine may not have.
    assert not re.search("[\U0001f300-\U0001faff\u2700-\u270d\u270f-\u27bf]", css)
