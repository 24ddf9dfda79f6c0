"""The pure parts of handling dead letters: whether a retry's work is still wanted, what an id
looks like, and reading a dead letter's clear fields whatever they hold."""

from __future__ import annotations

from typing import Any

import pytest

from broker import deadletters
from broker.replies import Entry
from deferral.states import TaskState

DEFERRED = deadletters.TaskFacts(TaskState.DEFERRED, 7, 1)


@pytest.mark.parametrize(
    ("work", "facts", "expected"),
    [
        (deadletters.TriggerWork(7, 1, 1), deadletters.Facts(DEFERRED, trigger_exists=True), None),
        (deadletters.TriggerWork(7, 1, 0), deadletters.Facts(DEFERRED, trigger_exists=True), None),
        (
            deadletters.TriggerWork(7, 1, 1),
            deadletters.Facts(DEFERRED, trigger_exists=False),
            "trigger 7 no longer exists",
        ),
        (
            deadletters.TriggerWork(7, 1, 2),
            deadletters.Facts(DEFERRED, trigger_exists=True),
            "its task deferred in try 2, and is at try 1",
        ),
        (
            deadletters.TriggerWork(8, 1, 1),
            deadletters.Facts(DEFERRED, trigger_exists=True),
            "its task is deferred, no longer deferred on trigger 8",
        ),
        (deadletters.EventWork(7, "k"), deadletters.Facts(DEFERRED), None),
        (
            deadletters.EventWork(7, "k"),
            deadletters.Facts(None),
            "no task waits on trigger 7",
        ),
        (
            deadletters.QueueWork(1, 2),
            deadletters.Facts(deadletters.TaskFacts(TaskState.QUEUED, None, 2)),
            None,
        ),
        (
            deadletters.QueueWork(1, 2),
            deadletters.Facts(None),
            "task instance 1 no longer exists",
        ),
    ],
)
def test_refusal(work: Any, facts: deadletters.Facts, expected: str | None) -> None:
    assert deadletters.refusal(work, facts) == expected


@pytest.mark.parametrize(
    ("text", "valid"),
    [
        ("1700000000000-0", True),
        ("1-0", True),
        ("1700000000000", False),
        ("1-0 ", False),
        ("-", False),
        ("1-0\n2-0", False),
        ("1" * 21 + "-0", False),
        ("+", False),
    ],
)
def test_valid_dead_id(text: str, valid: bool) -> None:
    assert deadletters.valid_dead_id(text) is valid


def test_a_dead_letter_is_read_whatever_its_fields_hold() -> None:
    entry = Entry(
        "p:dead",
        "1700000000000-3",
        {
            b"source_stream": b"p:triggers",
            b"error": b"line one\nline two\x1b[31m" + b"x" * 2000,
            b"deliveries": b"many",
            b"task": b"\xff\xfe",
            b"unexpected": b"ignored",
        },
    )
    letter = deadletters.read_dead_letter(entry)
    assert letter.id == "1700000000000-3" and letter.added_at.year == 2023
    assert letter.source_stream == "p:triggers" and letter.source_id == ""
    assert "\n" not in letter.error and "\x1b" not in letter.error
    assert letter.error.startswith("line one\\nline two\\x1b[31m") and len(letter.error) == 500
    assert letter.deliveries is None and letter.task == "\ufffd\ufffd"
    assert letter.sealed is False
