"""The pure parts of handling dead letters: whether a retry's work is still wanted, what an id
looks like, and reading a dead letter's clear fields whatever they hold."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
from cryptography.fernet import Fernet

from broker import deadletters
from broker.replies import Entry
from broker.streams import TriggerSpec
from broker.trigger_rows import TriggerRow
from deferral.runtime.crypto import Cipher
from deferral.states import TaskState

DEFERRED = deadletters.TaskFacts(TaskState.DEFERRED, 7, 1)
CLASSPATH = "deferral.triggers.temporal.DateTimeTrigger"
# The row of trigger 7, which its task (1, "d.r.t", at try 1) defers on.
ROW = TriggerRow(CLASSPATH, False, True, "d.r.t", 1, True)


def _work(trigger_id: int = 7, try_number: int = 1, classpath: str = CLASSPATH) -> Any:
    return deadletters.TriggerWork(TriggerSpec(trigger_id, classpath, {}, 1, "d.r.t", try_number))


@pytest.mark.parametrize(
    ("work", "facts", "expected"),
    [
        (_work(), deadletters.Facts(DEFERRED, ROW), None),
        (_work(try_number=0), deadletters.Facts(DEFERRED, ROW), None),
        (
            _work(),
            deadletters.Facts(DEFERRED, replace(ROW, classpath=None, waited_on=False)),
            "trigger 7 no longer exists",
        ),
        (
            _work(),
            deadletters.Facts(DEFERRED, replace(ROW, waited_on=False, deferred_on_it=False)),
            "trigger 7 is no longer waited on",
        ),
        (
            _work(8),
            deadletters.Facts(DEFERRED, ROW),
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
    ("work", "expected"),
    [
        (_work(), None),
        (_work(classpath="deferral.triggers.file.FileTrigger"), "classpath check"),
        (_work(try_number=2), "try check"),
        (deadletters.EventWork(7, "k"), None),
    ],
)
def test_a_trigger_entry_is_re_driven_only_as_postgresql_holds_it(
    work: Any, expected: str | None
) -> None:
    wrong = deadletters.mismatch(work, deadletters.Facts(DEFERRED, ROW))
    assert (wrong if wrong is None else wrong.split(":")[0]) == expected


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
    letter = deadletters.read_dead_letter(Cipher([Fernet.generate_key().decode()]), entry)
    assert letter.id == "1700000000000-3" and letter.added_at.year == 2023
    assert letter.source_stream == "p:triggers" and letter.source_id == ""
    assert "\n" not in letter.error and "\x1b" not in letter.error
    assert letter.error.startswith("line one\\nline two\\x1b[31m") and len(letter.error) == 500
    assert letter.deliveries is None and letter.task == "\ufffd\ufffd"
    assert letter.sealed is False
    assert letter.verified is False  # no MAC
