"""`--log-format json`: ISO 8601 UTC timestamps and the ids a record is about, as fields."""

from __future__ import annotations

import json
import logging
import re
import sys

import pytest

from deferral.runtime.process import (
    JsonFormatter,
    TextFormatter,
    log_ids,
    setup_logging,
    utc_timestamp,
)


def _record(**extra: object) -> logging.LogRecord:
    logger = logging.getLogger("deferral.test")
    record = logger.makeRecord(
        "deferral.test", logging.INFO, __file__, 1, "running %s try %d", ("d.r.t", 2), None
    )
    for key, value in extra.items():
        setattr(record, key, value)
    record.created = 1714564800.5  # 2024-05-01T12:00:00.5Z
    return record


def test_timestamps_are_iso_8601_utc_to_the_millisecond() -> None:
    assert utc_timestamp(1714564800.5) == "2024-05-01T12:00:00.500Z"


def test_a_record_about_a_task_carries_its_ids_as_fields() -> None:
    ids = log_ids(task="d.r.t", task_instance_id=7, try_number=2, trigger_id=None)
    entry = json.loads(JsonFormatter().format(_record(**ids)))
    assert entry == {
        "timestamp": "2024-05-01T12:00:00.500Z",
        "level": "info",
        "logger": "deferral.test",
        "message": "running d.r.t try 2",
        "task": "d.r.t",
        "task_instance_id": 7,
        "try_number": 2,
    }


def test_a_record_about_nothing_in_particular_has_no_id_fields() -> None:
    entry = json.loads(JsonFormatter().format(_record()))
    assert set(entry) == {"timestamp", "level", "logger", "message"}


def test_an_exception_is_one_field() -> None:
    try:
        raise ValueError("boom")
    except ValueError:
        record = _record(**log_ids(trigger_id=5))
        record.exc_info = sys.exc_info()
    entry = json.loads(JsonFormatter().format(record))
    assert entry["trigger_id"] == 5
    assert entry["exception"].startswith("Traceback") and "ValueError: boom" in entry["exception"]


def test_the_text_format_stays_readable(capsys: pytest.CaptureFixture[str]) -> None:
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    try:
        setup_logging("text")
        logging.getLogger("deferral.test").info(
            "running %s", "d.r.t", extra=log_ids(task="d.r.t", try_number=1)
        )
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)
    line = capsys.readouterr().err.strip()
    assert re.fullmatch(
        r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} INFO deferral.test: running d.r.t", line
    )


def _text_line(message: str, *args: object, exc_info: bool = False) -> str:
    record = logging.LogRecord("deferral.scheduler", logging.INFO, __file__, 1, message, args, None)
    if exc_info:
        try:
            raise ValueError("boom")
        except ValueError:
            record.exc_info = sys.exc_info()
    return TextFormatter().format(record)


def test_a_run_id_with_a_newline_does_not_forge_a_log_line() -> None:
    forged = "x\n2026-01-01 00:00:00,000 ERROR deferral.scheduler: database wiped"
    shown = _text_line("run %s of DAG %s finished", forged, "d")
    lines = shown.splitlines()
    assert len(lines) == 2 and lines[1].startswith("    2026-01-01")  # a continuation, indented
    assert re.match(
        r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} INFO deferral.scheduler: run x$", lines[0]
    )


def test_control_characters_in_a_log_line_are_escaped() -> None:
    shown = _text_line("task %s started", "d.r\x1b]0;pwned\x07\r\x00.t\u202e")
    assert shown.endswith(r"task d.r\x1b]0;pwned\x07\x0d\x00.t\u202e started")
    assert all(ord(c) >= 0x20 for c in shown)


def test_a_traceback_stays_readable_every_line_indented() -> None:
    lines = _text_line("trigger %d failed", 3, exc_info=True).splitlines()
    assert lines[0].endswith("trigger 3 failed")
    assert lines[1] == "    Traceback (most recent call last):"
    assert lines[-1] == "    ValueError: boom"
