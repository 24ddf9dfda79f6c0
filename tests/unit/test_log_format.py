"""`--log-format json`: ISO 8601 UTC timestamps and the ids a record is about, as fields."""

from __future__ import annotations

import json
import logging
import re
import sys

import pytest

from deferral.process import JsonFormatter, log_ids, setup_logging, utc_timestamp


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
