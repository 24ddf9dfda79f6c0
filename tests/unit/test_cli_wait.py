"""What `dags trigger --wait` shows: a line per change to a file, a block redrawn on a terminal."""

from __future__ import annotations

import datetime as dt
import io
import time
from collections.abc import Iterator

import pytest

from deferral_cli.wait import LiveBlock, PlainLines, RunStatus, TaskStatus, block, changes

QUEUED = RunStatus("queued", ())
STARTED = RunStatus("running", (TaskStatus("wait", "scheduled", 1), TaskStatus("m[0]", "none", 0)))
DEFERRED = RunStatus("running", (TaskStatus("wait", "deferred", 1), TaskStatus("m[0]", "none", 0)))
RETRIED = RunStatus("running", (TaskStatus("wait", "deferred", 2), TaskStatus("m[0]", "none", 0)))
DONE = RunStatus("success", (TaskStatus("wait", "success", 2), TaskStatus("m[0]", "success", 1)))


def test_changes_names_the_run_then_each_task_that_changed_a_finished_run_last() -> None:
    assert changes(None, QUEUED) == ["run: queued"]
    assert changes(QUEUED, STARTED) == [
        "run: running",
        "wait: scheduled (try 1)",
        "m[0]: none (try 0)",
    ]
    assert changes(STARTED, DEFERRED) == ["wait: deferred (try 1)"]
    assert changes(DEFERRED, DEFERRED) == []
    assert changes(DEFERRED, RETRIED) == ["wait: deferred (try 2)"]  # a new try is a change
    assert changes(RETRIED, DONE) == [  # a finished run after its tasks
        "wait: success (try 2)",
        "m[0]: success (try 1)",
        "run: success",
    ]


def test_block_aligns_the_tasks_under_the_run() -> None:
    assert block("d r1", DEFERRED, 12.4) == [
        "d r1: running (12s)",
        "  wait  deferred  try 1",
        "  m[0]  none      try 0",
    ]
    assert block("d r1", QUEUED, 0) == ["d r1: queued (0s)"]


@pytest.fixture
def paris_time(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """This process's local time zone is Paris's for the test."""
    monkeypatch.setenv("TZ", "Europe/Paris")
    time.tzset()
    yield
    monkeypatch.undo()
    time.tzset()


@pytest.mark.usefixtures("paris_time")
def test_plain_lines_print_only_changes_with_the_time() -> None:
    # Local time, with the date and the zone, as log lines read.
    out = io.StringIO()
    lines = PlainLines(out, lambda: dt.datetime(2024, 5, 1, 9, 30, 5, tzinfo=dt.UTC))
    for status in (QUEUED, QUEUED, STARTED, DEFERRED, DEFERRED, DONE):
        lines.show(status, 1.0)
    assert out.getvalue().splitlines() == [
        "2024-05-01 11:30:05 CEST run: queued",
        "2024-05-01 11:30:05 CEST run: running",
        "2024-05-01 11:30:05 CEST wait: scheduled (try 1)",
        "2024-05-01 11:30:05 CEST m[0]: none (try 0)",
        "2024-05-01 11:30:05 CEST wait: deferred (try 1)",
        "2024-05-01 11:30:05 CEST wait: success (try 2)",
        "2024-05-01 11:30:05 CEST m[0]: success (try 1)",
        "2024-05-01 11:30:05 CEST run: success",
    ]
    assert "\x1b" not in out.getvalue()


def test_live_block_redraws_in_place() -> None:
    out = io.StringIO()
    live = LiveBlock(out, "d r1", height=24)
    live.show(QUEUED, 0)
    assert out.getvalue() == "\x1b[2Kd r1: queued (0s)\n\x1b[J"
    live.show(DEFERRED, 3)
    redraw = out.getvalue().removeprefix("\x1b[2Kd r1: queued (0s)\n\x1b[J")
    # Back up over the one line drawn, then draw the three lines of the block.
    assert redraw == (
        "\x1b[1F"
        "\x1b[2Kd r1: running (3s)\n"
        "\x1b[2K  wait  deferred  try 1\n"
        "\x1b[2K  m[0]  none      try 0\n"
        "\x1b[J"
    )
    live.show(DONE, 4)
    assert out.getvalue().endswith("\x1b[J") and "\x1b[3F" in out.getvalue()


def test_a_block_taller_than_the_terminal_lists_the_unfinished_tasks_and_counts_the_rest() -> None:
    tasks = tuple(TaskStatus(f"m[{i}]", "success" if i % 3 else "running", 1) for i in range(10))
    lines = block("d r1", RunStatus("running", tasks), 5, max_tasks=4)
    assert lines == [
        "d r1: running (5s)",
        "  m[0]  running  try 1",
        "  m[3]  running  try 1",
        "  m[6]  running  try 1",
        "  and 7 more: 1 running, 6 success",
    ]
    assert len(block("d r1", RunStatus("running", tasks), 5, max_tasks=10)) == 11


def test_live_block_fits_the_terminal() -> None:
    out = io.StringIO()
    tasks = tuple(TaskStatus(f"m[{i}]", "running", 1) for i in range(50))
    LiveBlock(out, "d r1", height=10).show(RunStatus("running", tasks), 1)
    assert out.getvalue().count("\n") == 8  # the run, 6 tasks, the count of the rest


SIGNALED = RunStatus(
    "running",
    (
        TaskStatus("wait", "deferred", 1, "a signal sent to key 'k' (`deferral signals send k`)"),
        TaskStatus("m[0]", "none", 0),
    ),
)


def test_a_task_waiting_on_a_send_is_shown_with_what_resumes_it() -> None:
    assert changes(STARTED, SIGNALED) == [
        "wait: deferred (try 1); resumed by a signal sent to key 'k' (`deferral signals send k`)"
    ]
    assert block("d r1", SIGNALED, 3) == [
        "d r1: running (3s)",
        "  wait  deferred  try 1",
        "    resumed by a signal sent to key 'k' (`deferral signals send k`)",
        "  m[0]  none      try 0",
    ]
    # On a terminal too short for the hint beside every task, the tasks come first.
    assert block("d r1", SIGNALED, 3, max_tasks=2) == [
        "d r1: running (3s)",
        "  wait  deferred  try 1",
        "  m[0]  none      try 0",
    ]
