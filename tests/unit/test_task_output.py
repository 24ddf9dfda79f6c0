"""The capture of task attempts' output (worker.capture.TaskOutput), in this process: fds 1
and 2 into batches of lines of the running try, in the order written, whatever wrote them; one
reader for every attempt of the process."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
from collections.abc import Sequence

from deferral.store.tasklogs import NewLine
from tests.helpers import wait_for
from worker.capture import TaskOutput


class Store:
    def __init__(self, fail_first: int = 0) -> None:
        self.batches: list[list[NewLine]] = []
        self.bounds: list[int] = []
        self.fail_first = fail_first
        self.calls = 0

    def __call__(self, lines: Sequence[NewLine], max_bytes: int) -> None:
        self.calls += 1
        if self.calls <= self.fail_first:
            raise ConnectionError("database down")
        if lines:
            self.batches.append(list(lines))
            self.bounds.append(max_bytes)

    @property
    def texts(self) -> list[str]:
        return [line.text for batch in self.batches for line in batch]

    def texts_of(self, try_number: int) -> list[str]:
        return [
            line.text for batch in self.batches for line in batch if line.try_number == try_number
        ]


def test_print_logging_subprocess_and_raw_writes_arrive_in_order() -> None:
    store = Store()
    with TaskOutput(store) as output, output.attempt(7, 2, max_bytes=10_000):
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
    assert store.bounds == [10_000]


def test_each_attempt_gets_its_own_lines_complete_when_it_ends_from_one_reader() -> None:
    store = Store()
    with TaskOutput(store) as output:
        readers = []
        for try_number in (1, 2, 3):
            with output.attempt(7, try_number, max_bytes=10_000):
                print(f"try {try_number} says")
                os.write(2, f"try {try_number} unfinished line".encode())
                readers.append({t.ident for t in threading.enumerate() if t.name == "task-output"})
            # Stored before attempt() returned, the unfinished line too.
            assert store.texts_of(try_number) == [
                f"try {try_number} says",
                f"try {try_number} unfinished line",
            ]
    assert len(readers[0]) == 1 and readers[0] == readers[1] == readers[2]
    assert not [t for t in threading.enumerate() if t.name == "task-output"]


def test_what_is_written_between_attempts_goes_to_stderr_not_a_try(capfd: object) -> None:
    store = Store()
    with TaskOutput(store) as output:
        with output.attempt(7, 1, max_bytes=10_000):
            print("in the attempt")
        os.write(1, b"between attempts\nunfinished")
        with output.attempt(7, 2, max_bytes=10_000):
            print("in the next")
        os.write(1, b"unfinished again")
        # This time the reader has it in hand when the attempt starts (above, maybe not).
        wait_for(lambda: output._partial == b"unfinished again", what="the reader took it in")
        with output.attempt(7, 3, max_bytes=10_000):
            print("in the last")
    assert store.texts == ["in the attempt", "in the next", "in the last"]
    err = capfd.readouterr().err  # type: ignore[attr-defined]
    assert "between attempts\nunfinished\n" in err and "unfinished again\n" in err


def test_an_attempt_that_moves_its_fds_and_streams_does_not_lose_the_next_ones_output() -> None:
    store = Store()
    root = logging.getLogger()
    with TaskOutput(store) as output:
        with output.attempt(7, 1, max_bytes=10_000):
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, 1)
            os.close(devnull)
            sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - the task leaks it on purpose
            root.handlers.clear()
            root.setLevel(logging.ERROR)
        with output.attempt(7, 2, max_bytes=10_000):
            print("printed")
            logging.getLogger("my.task").info("logged")
    assert store.texts_of(2) == ["printed", "INFO my.task: logged"]


def test_an_attempt_that_closes_its_streams_does_not_break_the_next_one() -> None:
    store = Store()
    with TaskOutput(store) as output:
        with output.attempt(7, 1, max_bytes=10_000):
            sys.stdout.close()
            sys.stderr.close()
        with output.attempt(7, 2, max_bytes=10_000):
            print("printed")
            logging.getLogger("my.task").warning("logged")
    assert store.texts_of(2) == ["printed", "WARNING my.task: logged"]


def test_everything_is_restored_afterwards(capfd: object) -> None:
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    with TaskOutput(Store()) as output, output.attempt(7, 1, max_bytes=10_000):
        pass
    print("after the capture")
    assert root.handlers == handlers and root.level == level
    assert "after the capture" in capfd.readouterr().out  # type: ignore[attr-defined]


def test_lines_are_written_while_the_task_runs_and_kept_when_a_write_fails() -> None:
    store = Store(fail_first=1)
    written = threading.Event()
    original = store.__call__

    def store_and_say(lines: Sequence[NewLine], max_bytes: int) -> None:
        original(lines, max_bytes)
        written.set()

    with TaskOutput(store_and_say) as output, output.attempt(7, 1, max_bytes=10_000):
        print("early")
        assert written.wait(10)  # the first batch failed: retried half a second later
        assert store.texts == ["early"]
        print("late")
    assert store.texts == ["early", "late"]


def test_memory_holds_at_most_one_line_past_the_bound_of_each_try() -> None:
    store = Store()
    with TaskOutput(store) as output:
        for try_number in (1, 2):
            with output.attempt(7, try_number, max_bytes=25):
                for n in range(100):
                    print(f"line {n:04d}")  # 9 bytes each
    assert store.texts_of(1) == store.texts_of(2) == ["line 0000", "line 0001", "line 0002"]


def test_a_long_line_is_split() -> None:
    store = Store()
    with TaskOutput(store) as output, output.attempt(7, 1, max_bytes=1_000_000):
        os.write(1, b"x" * (64 * 1024 + 10) + b"\n")
    assert [len(text) for text in store.texts] == [64 * 1024, 10]
