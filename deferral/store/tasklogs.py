"""Task logs: per try of a task instance, what the attempt wrote (stdout, stderr, ``logging``),
what the worker wrote about the attempt, and what the triggerer wrote about the try's triggers,
kept in Postgres so that any host can read them (``deferral tasks logs``, the web UI).

Every writer goes through :func:`append`, in batches: it masks secrets (with the masker of the
writing process, which knows the secrets read there) and keeps each try within
``DEFERRAL_TASK_LOG_MAX_BYTES``. The bound counts what task code and triggers write; the
worker's own few lines (the start, the outcome and its traceback) are always kept, so that a try
whose log was cut still says how it ended. Where the bound is passed, one marker line (source
``cut``) stands for everything dropped after it.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import psycopg
from sqlalchemy import select, text
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import Session

from deferral.runtime.secrets_masker import redact
from deferral.runtime.storable import storable_text
from deferral.states import TaskState
from deferral.store.tables import TaskLog, TaskLogTry

# Where a line comes from.
SOURCE_TASK = "task"  # the attempt's stdout, stderr and logging
SOURCE_WORKER = "worker"  # the worker, about the attempt (start, outcome)
SOURCE_TRIGGERER = "triggerer"  # the triggerer, about the try's trigger
SOURCE_CUT = "cut"  # the marker where the try's log was cut
# The sources DEFERRAL_TASK_LOG_MAX_BYTES bounds.
BOUNDED_SOURCES = frozenset({SOURCE_TASK, SOURCE_TRIGGERER})
# How logging records read in a task log (the line's time is stored beside its text).
LOG_FORMAT = "%(levelname)s %(name)s: %(message)s"


@dataclass(frozen=True)
class LogLine:
    """A stored line, as readers get it; ``id`` orders the lines of a try."""

    id: int
    at: dt.datetime
    source: str
    text: str


class NewLine(NamedTuple):
    """A line to store for a try (a named tuple: writers make many, cheaply)."""

    task_instance_id: int
    try_number: int
    at: dt.datetime
    source: str
    text: str


@dataclass(frozen=True)
class TrySize:
    """What a try's bounded lines hold so far, and whether its log was cut."""

    bytes: int = 0
    cut: bool = False


def read_lines(
    session: Session,
    task_instance_id: int,
    try_number: int,
    after_id: int = 0,
    limit: int | None = None,
) -> list[LogLine]:
    """The lines of one try after ``after_id``, in order (at most ``limit``). A try's lines are
    numbered in commit order, so polling with the last id seen misses none."""
    query = (
        select(TaskLog.id, TaskLog.at, TaskLog.source, TaskLog.text)
        .where(
            TaskLog.task_instance_id == task_instance_id,
            TaskLog.try_number == try_number,
            TaskLog.id > after_id,
        )
        .order_by(TaskLog.id)
        .limit(limit)
    )
    return [LogLine(*row) for row in session.execute(query)]


def tries_with_logs(session: Session, task_instance_id: int) -> list[int]:
    """The tries of a task instance that have log lines, in order."""
    return list(
        session.scalars(
            select(TaskLogTry.try_number)
            .where(TaskLogTry.task_instance_id == task_instance_id)
            .order_by(TaskLogTry.try_number)
        )
    )


def cut_marker(max_bytes: int) -> str:
    return (
        f"[log cut: this try's task and triggerer lines passed {max_bytes} bytes"
        " (DEFERRAL_TASK_LOG_MAX_BYTES); the later ones are not kept]"
    )


def within_bound(
    lines: Sequence[NewLine], size: TrySize, max_bytes: int
) -> tuple[list[NewLine], TrySize]:
    """Of one try's new lines, in order, those to store and the try's size after them: worker
    lines always; task and triggerer lines while the try stays within ``max_bytes`` (UTF-8).
    The first line that would pass it becomes the cut marker; bounded lines after it go."""
    kept: list[NewLine] = []
    used, cut = size.bytes, size.cut
    for line in lines:
        if line.source not in BOUNDED_SOURCES:
            kept.append(line)
            continue
        if cut:
            continue
        length = len(line.text.encode())
        if used + length > max_bytes:
            cut = True
            kept.append(line._replace(source=SOURCE_CUT, text=cut_marker(max_bytes)))
            continue
        used += length
        kept.append(line)
    return kept, TrySize(used, cut)


def clean(line: str) -> str:
    """What may be stored of a line: secrets masked, and what PostgreSQL text cannot hold (NUL,
    lone surrogates) escaped (``deferral.runtime.storable``)."""
    return storable_text(str(redact(line)))


# Creates (or locks) the size row of each try, in the order given, for tries whose task
# instance exists; a log line must never fail its writer's transaction. An existing row is only
# locked: ON CONFLICT DO UPDATE locks every conflicting row, and its WHERE (false) keeps it from
# writing a new version of a row whose size does not change (a no-op update was 7 of the 42 row
# writes of a deferred-and-resumed task). Rows locked that way are not returned.
_TRY_ROWS = """
    INSERT INTO task_log_try (task_instance_id, try_number)
    SELECT k.ti, k.try_number
    FROM unnest(CAST(:tis AS bigint[]), CAST(:tries AS integer[])) WITH ORDINALITY
        AS k(ti, try_number, n)
    WHERE EXISTS (SELECT 1 FROM task_instance ti WHERE ti.id = k.ti)
    ORDER BY k.n
    ON CONFLICT (task_instance_id, try_number) DO UPDATE SET bytes = task_log_try.bytes
    WHERE false
"""

_LOCK_TRIES = text(_TRY_ROWS)

# Read once the rows are locked, by a statement of its own: its snapshot then shows what the
# writers that held them before committed.
_TRY_SIZES = text(
    """
    SELECT t.task_instance_id, t.try_number, t.bytes, t.cut
    FROM task_log_try t
    JOIN unnest(CAST(:tis AS bigint[]), CAST(:tries AS integer[])) AS k(ti, try_number)
        ON t.task_instance_id = k.ti AND t.try_number = k.try_number
    """
)

# One try's size row, locked and read in one statement: a row FOR UPDATE had to wait for is
# returned as its holder committed it. No row (the try's first lines): _LOCK_TRIES creates it.
_LOCK_ONE_SIZE = text(
    """
    SELECT task_instance_id, try_number, bytes, cut FROM task_log_try
    WHERE task_instance_id = :ti AND try_number = :try_number
    FOR UPDATE
    """
)

_RECORD_SIZES = """
    UPDATE task_log_try t SET bytes = s.bytes, cut = s.cut
    FROM unnest(CAST(:size_tis AS bigint[]), CAST(:size_tries AS integer[]),
                CAST(:bytes AS bigint[]), CAST(:cuts AS boolean[])) AS s(ti, try_number, bytes, cut)
    WHERE t.task_instance_id = s.ti AND t.try_number = s.try_number
    """

_RECORD_SIZES_ONLY = text(_RECORD_SIZES)

# Lines given as arrays, inserted in their order (ids are drawn in it).
_INSERT_LINES = """
    INSERT INTO task_log (task_instance_id, try_number, at, source, text)
    SELECT l.ti, l.try_number, l.at, l.source, l.text
    FROM {locked}
        unnest(CAST(:line_tis AS bigint[]), CAST(:line_tries AS integer[]),
               CAST(:ats AS timestamptz[]), CAST(:sources AS text[]), CAST(:texts AS text[]))
        WITH ORDINALITY AS l(ti, try_number, at, source, text, n)
    {where}
    ORDER BY l.n
    """

# A few lines and the sizes they change, in one statement (COPY and the size update took
# three round trips on every resume's path: its triggerer lines).
_INSERT_LINES_AND_SIZES = text(
    f"WITH sized AS ({_RECORD_SIZES})" + _INSERT_LINES.format(locked="", where="")
)

# Up to this many lines go in one INSERT with the sizes; more by COPY, quicker per line.
_INSERTED_AT_MOST = 50

_COPY_LINES = "COPY task_log (task_instance_id, try_number, at, source, text) FROM STDIN"


def _copy_lines(session: Session, rows: Sequence[NewLine]) -> None:
    """Insert lines with COPY, in the session's transaction: several times faster than a
    multi-row INSERT."""
    connection = session.connection().connection.driver_connection
    assert isinstance(connection, psycopg.Connection)
    try:
        with connection.cursor() as cursor, cursor.copy(_COPY_LINES) as copy:
            for row in rows:
                copy.write_row(row)
    except psycopg.Error as exc:
        # Raised as SQLAlchemy raises its statements' errors, so that callers judge it as they
        # judge any other (faults.is_transient): a deadlock with a user action's update of the
        # task instance, raised bare, stopped a triggerer (its log writer retries transients).
        raise DBAPIError.instance(_COPY_LINES, None, exc, psycopg.Error) from exc


def _line_arrays(lines: Sequence[NewLine]) -> dict[str, list[object]]:
    return {
        "line_tis": [line.task_instance_id for line in lines],
        "line_tries": [line.try_number for line in lines],
        "ats": [line.at for line in lines],
        "sources": [line.source for line in lines],
        "texts": [line.text for line in lines],
    }


# Lines no bound applies to (the worker's own), in one statement: the tries' size rows are
# created or locked (in key order) as _LOCK_TRIES does, and the lines of tries whose task
# instance exists are inserted after, in order: the count over ``tries`` is computed before the
# first line is read, so the ids are drawn once the locks are held (commit order).
_APPEND_UNBOUNDED = text(
    "WITH tries AS ("
    + _TRY_ROWS
    + "RETURNING 1)"
    + _INSERT_LINES.format(
        locked="(SELECT count(*) FROM tries) AS locked,",
        where="WHERE EXISTS (SELECT 1 FROM task_instance ti WHERE ti.id = l.ti)",
    )
)


def append(session: Session, lines: Sequence[NewLine], max_bytes: int) -> None:
    """Store ``lines`` (in order) in the caller's transaction: lock their tries' size rows (in
    key order, so writers of one try take turns and never deadlock) and read their sizes,
    insert what :func:`within_bound` keeps, record the sizes that changed. One try's few
    lines (an event's triggerer lines, on every resume's path) take two statements; a batch
    of several tries four, whatever their number. Lines of a task instance that no longer
    exists are dropped. Lines no bound applies to take one statement (a worker's few lines
    about each attempt, on every attempt's path)."""
    if not lines:
        return
    by_try: dict[tuple[int, int], list[NewLine]] = {}
    for line in (line._replace(text=clean(line.text)) for line in lines):
        by_try.setdefault((line.task_instance_id, line.try_number), []).append(line)
    keys = sorted(by_try)
    if all(line.source not in BOUNDED_SOURCES for line in lines):
        ordered = [line for new in by_try.values() for line in new]
        session.execute(
            _APPEND_UNBOUNDED,
            {"tis": [k[0] for k in keys], "tries": [k[1] for k in keys], **_line_arrays(ordered)},
        )
        return
    sizes = _lock_sizes(session, keys)
    rows: list[NewLine] = []
    changed: dict[tuple[int, int], TrySize] = {}
    for key, new in by_try.items():
        if key not in sizes:
            continue
        kept, after = within_bound(new, sizes[key], max_bytes)
        rows += kept
        if after != sizes[key]:
            changed[key] = after
    recorded = {
        "size_tis": [k[0] for k in changed],
        "size_tries": [k[1] for k in changed],
        "bytes": [s.bytes for s in changed.values()],
        "cuts": [s.cut for s in changed.values()],
    }
    if rows and len(rows) <= _INSERTED_AT_MOST:
        session.execute(_INSERT_LINES_AND_SIZES, {**recorded, **_line_arrays(rows)})
        return
    if rows:
        _copy_lines(session, rows)
    if changed:
        session.execute(_RECORD_SIZES_ONLY, recorded)


def _lock_sizes(
    session: Session, keys: Sequence[tuple[int, int]]
) -> dict[tuple[int, int], TrySize]:
    """Lock the size rows of these tries (sorted), creating those missing, and read them."""
    if len(keys) == 1:
        ((ti, try_number),) = keys
        row = session.execute(_LOCK_ONE_SIZE, {"ti": ti, "try_number": try_number}).first()
        if row is not None:
            return {keys[0]: TrySize(row.bytes, row.cut)}
    try_keys = {"tis": [k[0] for k in keys], "tries": [k[1] for k in keys]}
    session.execute(_LOCK_TRIES, try_keys)
    return {
        (row.task_instance_id, row.try_number): TrySize(row.bytes, row.cut)
        for row in session.execute(_TRY_SIZES, try_keys)
    }


# States in which a try is still going on: anything else ends it (finished, up_for_retry,
# cleared back to none).
_TRY_GOES_ON = frozenset(
    {
        TaskState.SCHEDULED,
        TaskState.QUEUED,
        TaskState.RUNNING,
        TaskState.DEFERRED,
        TaskState.UP_FOR_RESCHEDULE,
        TaskState.AWAITING_INPUT,
    }
)


def try_is_over(state: str, current_try: int, try_number: int) -> bool:
    """Whether try ``try_number`` of a task instance now at ``current_try`` in ``state`` has
    ended: nothing more comes from its attempts (a triggerer may still say it cancelled)."""
    return current_try > try_number or state not in _TRY_GOES_ON
