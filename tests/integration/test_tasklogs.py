"""Task logs in Postgres: order, tries, the bound per try and its cut marker, masking."""

from __future__ import annotations

import datetime as dt
import threading
from typing import Any

import psycopg
import pytest
from sqlalchemy import event, text
from sqlalchemy.exc import DBAPIError, OperationalError
from sqlalchemy.orm import Session, sessionmaker

from deferral.runtime.faults import is_transient
from deferral.runtime.secrets_masker import mask_secret
from deferral.store import tasklogs
from deferral.store.tasklogs import NewLine
from tests.helpers import lock_waiters, wait_for
from tests.integration.factories import running_task

NOW = dt.datetime(2024, 5, 1, 12, tzinfo=dt.UTC)


def _line(ti_id: int, text: str, source: str = "task", try_number: int = 1) -> NewLine:
    return NewLine(ti_id, try_number, NOW, source, text)


def test_lines_come_back_in_order_per_try_and_after_an_id(
    sessions: sessionmaker[Session],
) -> None:
    ti_id = running_task(sessions)
    with sessions.begin() as session:
        tasklogs.append(
            session,
            [_line(ti_id, "one"), _line(ti_id, "other try", try_number=2), _line(ti_id, "two")],
            max_bytes=1000,
        )
    with sessions.begin() as session:
        tasklogs.append(session, [_line(ti_id, "three", source="worker")], max_bytes=1000)

    with sessions() as session:
        lines = tasklogs.read_lines(session, ti_id, 1)
        assert [(line.source, line.text) for line in lines] == [
            ("task", "one"),
            ("task", "two"),
            ("worker", "three"),
        ]
        assert lines[0].at == NOW
        later = tasklogs.read_lines(session, ti_id, 1, after_id=lines[0].id, limit=1)
        assert [line.text for line in later] == ["two"]
        assert tasklogs.tries_with_logs(session, ti_id) == [1, 2]
        assert tasklogs.read_lines(session, ti_id, 3) == []


def test_a_try_is_cut_once_at_the_bound_but_keeps_worker_lines(
    sessions: sessionmaker[Session],
) -> None:
    ti_id = running_task(sessions)
    with sessions.begin() as session:
        tasklogs.append(session, [_line(ti_id, "x" * 6), _line(ti_id, "é" * 2)], max_bytes=12)
    with sessions.begin() as session:  # 10 bytes stored: "yyy" would pass 12
        tasklogs.append(
            session,
            [
                _line(ti_id, "yyy", source="triggerer"),
                _line(ti_id, "z"),
                _line(ti_id, "failed", source="worker"),
            ],
            max_bytes=12,
        )
    with sessions.begin() as session:
        tasklogs.append(session, [_line(ti_id, "after")], max_bytes=12)

    with sessions() as session:
        lines = tasklogs.read_lines(session, ti_id, 1)
    assert [(line.source, line.text) for line in lines] == [
        ("task", "xxxxxx"),
        ("task", "éé"),
        ("cut", tasklogs.cut_marker(12)),
        ("worker", "failed"),
    ]


def test_secrets_nul_and_surrogates_are_stored_safely(sessions: sessionmaker[Session]) -> None:
    ti_id = running_task(sessions)
    mask_secret("hunter2-s3cret")
    with sessions.begin() as session:
        tasklogs.append(
            session, [_line(ti_id, "password=hunter2-s3cret\x00 \udc80")], max_bytes=1000
        )
    with sessions() as session:
        (line,) = tasklogs.read_lines(session, ti_id, 1)
    assert line.text == "password=***\\x00 \\udc80"


def test_lines_of_a_task_instance_that_is_gone_are_dropped(
    sessions: sessionmaker[Session],
) -> None:
    ti_id = running_task(sessions)
    with sessions.begin() as session:
        tasklogs.append(session, [_line(ti_id + 1000, "nobody"), _line(ti_id, "kept")], 1000)
    with sessions() as session:
        assert [line.text for line in tasklogs.read_lines(session, ti_id, 1)] == ["kept"]
        assert tasklogs.tries_with_logs(session, ti_id + 1000) == []


def test_worker_lines_take_one_statement_in_order_and_name_their_tries(
    sessions: sessionmaker[Session],
) -> None:
    ti_id = running_task(sessions)
    statements: list[str] = []

    def count(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        statements.append(statement)

    lines = [
        _line(ti_id, "started", source="worker"),
        _line(ti_id, "try 2 said", source="worker", try_number=2),
        _line(ti_id + 1000, "nobody", source="worker"),
        _line(ti_id, "succeeded", source="worker"),
    ]
    with sessions.begin() as session:
        event.listen(session.connection(), "before_cursor_execute", count)
        tasklogs.append(session, lines, max_bytes=1)
    assert len(statements) == 1
    with sessions() as session:
        assert [line.text for line in tasklogs.read_lines(session, ti_id, 1)] == [
            "started",
            "succeeded",
        ]
        assert tasklogs.tries_with_logs(session, ti_id) == [1, 2]
        assert tasklogs.tries_with_logs(session, ti_id + 1000) == []


def _try_row_version(session: Session, ti_id: int) -> str:
    """The physical version of try 1's size row: a new one on every UPDATE of it."""
    return str(
        session.execute(
            text("SELECT xmin::text FROM task_log_try WHERE task_instance_id = :ti"), {"ti": ti_id}
        ).scalar_one()
    )


def test_appending_locks_the_tries_row_but_writes_it_only_when_its_size_changes(
    sessions: sessionmaker[Session],
) -> None:
    ti_id = running_task(sessions)
    with sessions.begin() as session:
        tasklogs.append(session, [_line(ti_id, "started", source="worker")], max_bytes=1000)
    with sessions() as session:
        created = _try_row_version(session, ti_id)

    for lines in ([_line(ti_id, "deferred", source="worker")], [_line(ti_id, "")]):
        with sessions.begin() as session:
            tasklogs.append(session, lines, max_bytes=1000)
            # Held until commit: a second writer of the try waits (here: cannot lock it at once).
            with sessions() as other, pytest.raises(OperationalError, match="could not obtain"):
                other.execute(
                    text(
                        "SELECT 1 FROM task_log_try WHERE task_instance_id = :ti FOR UPDATE NOWAIT"
                    ),
                    {"ti": ti_id},
                )
        with sessions() as session:
            assert _try_row_version(session, ti_id) == created  # locked, not rewritten

    with sessions.begin() as session:
        tasklogs.append(session, [_line(ti_id, "four", source="triggerer")], max_bytes=1000)
    with sessions() as session:
        assert _try_row_version(session, ti_id) != created
        assert [line.text for line in tasklogs.read_lines(session, ti_id, 1)] == [
            "started",
            "deferred",
            "",
            "four",
        ]
        bytes_used = session.execute(
            text("SELECT bytes FROM task_log_try WHERE task_instance_id = :ti"), {"ti": ti_id}
        ).scalar_one()
        assert bytes_used == 4


def _count_statements(session: Session) -> list[str]:
    statements: list[str] = []

    def count(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        statements.append(statement)

    event.listen(session.connection(), "before_cursor_execute", count)
    return statements


def _size(sessions: sessionmaker[Session], ti_id: int) -> tuple[int, bool]:
    with sessions() as session:
        row = session.execute(
            text("SELECT bytes, cut FROM task_log_try WHERE task_instance_id = :ti"), {"ti": ti_id}
        ).one()
    return row.bytes, row.cut


def test_a_few_lines_of_one_started_try_take_two_statements(
    sessions: sessionmaker[Session],
) -> None:
    ti_id = running_task(sessions)
    with sessions.begin() as session:  # the worker's start line makes the try's size row
        tasklogs.append(session, [_line(ti_id, "started", source="worker")], 100)
    with sessions.begin() as session:
        statements = _count_statements(session)
        tasklogs.append(session, [_line(ti_id, "fired", source="triggerer"), _line(ti_id, "")], 100)
    assert len(statements) == 2
    assert _size(sessions, ti_id) == (5, False)
    # The try's first lines (no size row yet) and several tries take the longer way, as do
    # more lines than one INSERT takes (COPY).
    many = [_line(ti_id, f"line {i:02d}", try_number=2) for i in range(tasklogs._INSERTED_AT_MOST)]
    many += [_line(ti_id, "of try 3", try_number=3)]
    with sessions.begin() as session:
        tasklogs.append(session, [*many, _line(ti_id, "over the bound", try_number=2)], 7 * 50)
    with sessions() as session:
        second = [line.text for line in tasklogs.read_lines(session, ti_id, 2)]
        third = [line.text for line in tasklogs.read_lines(session, ti_id, 3)]
    assert second == [f"line {i:02d}" for i in range(50)] + [tasklogs.cut_marker(350)]
    assert third == ["of try 3"]


def test_a_writer_that_waited_for_a_tries_row_sees_the_size_its_holder_committed(
    sessions: sessionmaker[Session],
) -> None:
    ti_id = running_task(sessions)
    with sessions.begin() as session:
        tasklogs.append(session, [_line(ti_id, "12345")], max_bytes=10)
    appended = threading.Event()

    def append_six_bytes() -> None:
        with sessions.begin() as session:
            tasklogs.append(session, [_line(ti_id, "678901")], max_bytes=10)
        appended.set()

    with sessions.begin() as holder:
        holder.execute(
            text("SELECT 1 FROM task_log_try WHERE task_instance_id = :ti FOR UPDATE"),
            {"ti": ti_id},
        )
        writer = threading.Thread(target=append_six_bytes)
        writer.start()
        wait_for(lambda: lock_waiters(sessions) == 1, timeout=30, what="the writer to wait")
        # The holder's own lines: 4 more bytes, committed while the writer waits.
        tasklogs.append(holder, [_line(ti_id, "abcd")], max_bytes=10)
    writer.join(timeout=30)
    assert appended.is_set()
    with sessions() as session:
        texts = [line.text for line in tasklogs.read_lines(session, ti_id, 1)]
    # 5 + 4 bytes committed before it read the size: its 6 would pass 10, so the try is cut.
    assert texts == ["12345", "abcd", tasklogs.cut_marker(10)]
    assert _size(sessions, ti_id) == (9, True)


def test_a_copy_of_lines_that_fails_raises_as_statements_do_and_a_lock_wait_is_transient(
    sessions: sessionmaker[Session],
) -> None:
    # COPY runs on the driver's connection: its errors were raised bare (psycopg's), so a
    # deadlock with a user action escaped the triggerer's retry of transient errors.
    ti_id = running_task(sessions)
    with sessions() as holder, sessions() as session:
        holder.execute(text("SELECT 1 FROM task_instance WHERE id = :i FOR UPDATE"), {"i": ti_id})
        session.execute(text("SET LOCAL lock_timeout = '200ms'"))
        with pytest.raises(DBAPIError) as raised:
            tasklogs._copy_lines(session, [_line(ti_id, "waits on the task instance's lock")])
    assert isinstance(raised.value.orig, psycopg.errors.LockNotAvailable)
    assert is_transient(raised.value)
