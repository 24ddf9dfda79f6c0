"""The capture of a task attempt's output (worker.capture.TaskOutput), in this process: fds 1
and 2 into batches of lines, in the order written, whatever wrote them."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
from collections.abc import Sequence

from deferral.tasklogs import NewLine
from worker.capture import TaskOutput


class Store:
    def __init__(self, fail_first: int = 0) -> None:
        self.batches: list[list[NewLine]] = []
        self.fail_first = fail_first
        self.calls = 0

    def __call__(self, lines: Sequence[NewLine]) -> None:
        self.calls += 1
        if self.calls <= self.fail_first:
            raise ConnectionError("database down")
        if lines:
            self.batches.append(list(lines))

    @property
    def texts(self) -> list[str]:
        return [line.text for batch in self.batches for line in batch]


def test_print_logging_subprocess_and_raw_writes_arrive_in_order() -> None:
    store = Store()
    with TaskOutput(7, 2, store, max_bytes=10_000):
        print("printed")
        logging.getLogger("my.task").info("logged %d", 1)
        print("to stderr", file=sys.stderr)
        subprocess.run(["echo", "from a subprocess"], check=True)
        os.write(1, b"raw fd write\r\nno newline at the end")
    assert store.texts == [
        "printed",
        "INFO my.task: logged 1",
        "to stderr",
        "from a subprocess",
        "raw fd write",
        "no newline at the end",
    ]
    first = store.batches[0][0]
    assert (first.task_instance_id, first.try_number, first.source) == (7, 2, "task")


def test_everything_is_restored_afterwards(capfd: object) -> None:
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    with TaskOutput(7, 1, Store(), max_bytes=10_000):
        pass
    print("after the attempt")
    assert root.handlers == handlers and root.level == level
    assert "after the attempt" in capfd.readouterr().out  # type: ignore[attr-defined]


def test_lines_are_written_while_the_task_runs_and_kept_when_a_write_fails() -> None:
    store = Store(fail_first=1)
    written = threading.Event()
    original = store.__call__

    def store_and_say(lines: Sequence[NewLine]) -> None:
        original(lines)
        written.set()

    with TaskOutput(7, 1, store_and_say, max_bytes=10_000):
        print("early")
        assert written.wait(10)  # the first batch failed: retried half a second later
        assert store.texts == ["early"]
        print("late")
    assert store.texts == ["early", "late"]


def test_memory_holds_at_most_one_line_past_the_bound() -> None:
    store = Store()
    with TaskOutput(7, 1, store, max_bytes=25):
        for n in range(100):
            print(f"line {n:04d}")  # 9 bytes each
    assert store.texts == ["line 0000", "line 0001", "line 0002"]


def test_a_long_line_is_split() -> None:
    store = Store()
    with TaskOutput(7, 1, store, max_bytes=1_000_000):
        os.write(1, b"x" * (64 * 1024 + 10) + b"\n")
    assert [len(text) for text in store.texts] == [64 * 1024, 10]
