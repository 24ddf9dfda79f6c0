"""Which of the triggerer's log records go to a try's log: those carrying the try's ids, and
those a trigger's own code emits in its task."""

from __future__ import annotations

import datetime as dt
import logging

import anyio

from broker.streams import CarriedLog
from deferral.runtime.process import LOG_IDS_ATTR, log_ids
from deferral.runtime.secrets_masker import mask_secret
from deferral.store.tasklogs import SOURCE_TRIGGERER, NewLine
from triggerer.tasklog import TaskLogHandler, current_ids, split_for_events

log = logging.getLogger("test.triggerer.tasklog")


def _handled(handler: TaskLogHandler, body: object) -> None:
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    try:
        anyio.run(body)  # type: ignore[arg-type]
    finally:
        log.removeHandler(handler)


def test_records_with_a_tries_ids_or_inside_a_trigger_go_to_that_try() -> None:
    handler = TaskLogHandler()

    async def body() -> None:
        log.info("about trigger 3", extra=log_ids(task_instance_id=7, try_number=2, trigger_id=3))
        log.info("no task here", extra=log_ids(trigger_id=3))
        log.info("not about any trigger")

        async def trigger_code() -> None:
            current_ids.set(log_ids(task_instance_id=8, try_number=1)[LOG_IDS_ATTR])
            log.warning("the trigger's own line")

        async with anyio.create_task_group() as tasks:
            tasks.start_soon(trigger_code)
        log.info("after the trigger's task: not its line")

    _handled(handler, body)
    lines = handler.take()
    assert [(line.task_instance_id, line.try_number, line.text) for line in lines] == [
        (7, 2, "INFO test.triggerer.tasklog: about trigger 3"),
        (8, 1, "WARNING test.triggerer.tasklog: the trigger's own line"),
    ]
    assert {line.source for line in lines} == {"triggerer"}
    assert handler.take() == []


def test_a_full_queue_counts_what_it_drops_and_takes_lines_back_first() -> None:
    handler = TaskLogHandler(max_queued=2)
    ids = log_ids(task_instance_id=7, try_number=1)

    async def body() -> None:
        for n in range(3):
            log.info("line %d", n, extra=ids)

    _handled(handler, body)
    taken = handler.take()
    assert [line.text.rsplit(" ", 1)[-1] for line in taken] == ["0", "1"]
    assert handler.dropped == 1

    async def later() -> None:
        log.info("line 3", extra=ids)

    _handled(handler, later)
    handler.put_back(taken)
    assert [line.text.rsplit(" ", 1)[-1] for line in handler.take()] == ["0", "3"]


def _line(ti: int, try_number: int, text: str) -> NewLine:
    return NewLine(ti, try_number, dt.datetime(2026, 1, 1, tzinfo=dt.UTC), SOURCE_TRIGGERER, text)


def test_the_lines_of_the_events_tries_travel_with_them_in_order_and_masked() -> None:
    mask_secret("s3cr3t-carried")
    lines = [
        _line(1, 1, "first"),
        _line(2, 1, "another try"),
        _line(1, 1, "fired: password s3cr3t-carried"),
        _line(3, 0, "a try the entry did not name"),
    ]
    split = split_for_events(lines, {(1, 1), (3, 0)})
    at = lines[0].at.timestamp()
    assert split.carried == {(1, 1): CarriedLog(1, 1, [(at, "first"), (at, "fired: password ***")])}
    assert split.store_first == [lines[3]]
    assert split.rest == [lines[1]]


def test_lines_too_long_to_travel_are_stored_first() -> None:
    lines = [_line(1, 1, "x" * 100), _line(1, 1, "y")]
    split = split_for_events(lines, {(1, 1)}, max_chars=50)
    assert split.carried == {}
    assert split.store_first == lines
