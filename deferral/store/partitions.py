"""The history tables, range-partitioned by day (native PostgreSQL partitioning).

``task_state_change`` (by ``at``), ``task_log`` (by ``at``) and ``resume_event`` (by
``received_at``) each have one partition per UTC day, named ``<table>_pYYYYMMDD`` and holding
``[day, day + 1)``; the partition that migration 0014 made of the table as it was, named
``<table>_beforeYYYYMMDD`` and holding everything before that day; and a default partition,
``<table>_default``, which catches a row no day partition holds (a day not made yet, a writer's
clock far off, history of an unfinished run kept when its day went).

The scheduler makes the partitions of the next ``AHEAD_DAYS`` days (:func:`make_ahead`);
retention drops a whole partition once its day is older than the cutoff (:func:`drop_older`),
first moving into the default partition the few rows that a run not finished before the cutoff
still needs. Both take a transaction-level advisory lock, so that several schedulers (and
``deferral db prune``) never make or drop the same partition at once; neither keeps session
state, so both work through PgBouncer in transaction pooling mode.
"""

from __future__ import annotations

import datetime as dt
import re
from dataclasses import dataclass

from sqlalchemy import text
from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import Session, sessionmaker

# Days of partitions made ahead of today: the scheduler makes them every hour, so a scheduler
# down for less than this never sends a row to the default partition.
AHEAD_DAYS = 3
# The advisory lock (pg_try_advisory_xact_lock's key) taken by whoever makes or drops partitions.
LOCK_KEY = 0x6465_6672_7061_7274  # "defrpart"
# DDL on a partitioned table waits at most this long for its lock (then the step is tried again
# at the scheduler's next pass), so that it never queues the hot path's inserts behind a long
# reader.
LOCK_TIMEOUT = "2s"


@dataclass(frozen=True)
class History:
    """A partitioned history table: its partition key and which of its rows a run not finished
    before the cutoff (``:age`` ago) still needs (``h`` is the row)."""

    table: str
    key: str
    needed: str


# A task instance (``h.task_instance_id``) whose run has not finished before the cutoff.
_RUN_NOT_FINISHED_BEFORE_CUTOFF = """EXISTS (
    SELECT 1 FROM task_instance ti
    JOIN dag_run dr ON dr.dag_id = ti.dag_id AND dr.run_id = ti.run_id
    WHERE ti.id = h.task_instance_id
      AND NOT (dr.state IN ('success', 'failed') AND dr.end_date < now() - :age))"""

HISTORY = (
    History("task_state_change", "at", _RUN_NOT_FINISHED_BEFORE_CUTOFF),
    History("task_log", "at", _RUN_NOT_FINISHED_BEFORE_CUTOFF),
    # Dedup keys matter only while the run can still receive events.
    History(
        "resume_event",
        "received_at",
        """EXISTS (
            SELECT 1 FROM task_instance ti
            JOIN dag_run dr ON dr.dag_id = ti.dag_id AND dr.run_id = ti.run_id
            WHERE ti.id = h.task_instance_id AND dr.state IN ('queued', 'running'))""",
    ),
)

_NAME = re.compile(r"^(?P<table>[a-z_]+)_(?P<kind>p|before)(?P<day>\d{8})$")


def is_partition(name: str) -> bool:
    """Whether the table ``name`` is a partition of a history table (the models declare only
    the partitioned tables)."""
    match = _NAME.match(name)
    if match is not None:
        return any(match["table"] == h.table for h in HISTORY)
    return any(name == f"{h.table}_default" for h in HISTORY)


def day_partition(table: str, day: dt.date) -> str:
    return f"{table}_p{day:%Y%m%d}"


def _bound(day: dt.date) -> str:
    return f"{day.isoformat()} 00:00:00+00"


def partitions(session: Session, table: str) -> dict[str, tuple[dt.datetime | None, dt.datetime]]:
    """The partitions of ``table`` that hold a range of days, by name, with the start of their
    range (None: from the beginning) and its (exclusive) end; not the default partition."""
    names = session.scalars(
        text(
            """SELECT c.relname FROM pg_inherits i
            JOIN pg_class c ON c.oid = i.inhrelid
            WHERE i.inhparent = CAST(:table AS regclass)"""
        ),
        {"table": table},
    )
    ranges: dict[str, tuple[dt.datetime | None, dt.datetime]] = {}
    for name in names:
        match = _NAME.match(name)
        if match is None or match["table"] != table:
            continue  # the default partition
        day = dt.datetime.strptime(match["day"], "%Y%m%d").replace(tzinfo=dt.UTC)
        if match["kind"] == "p":
            ranges[name] = (day, day + dt.timedelta(days=1))
        else:
            ranges[name] = (None, day)
    return ranges


def catch_alls(session: Session, table: str) -> list[str]:
    """The partitions of ``table`` that are not one day's: the default partition and the one
    migration 0014 made of the table as it was (if not dropped yet). Retention deletes their
    old rows one by one."""
    before = [name for name, (low, _) in partitions(session, table).items() if low is None]
    return [f"{table}_default", *sorted(before)]


def _lock_timed_out(exc: OperationalError) -> bool:
    """Whether ``exc`` is a DDL statement that waited ``LOCK_TIMEOUT`` for its lock."""
    return getattr(exc.orig, "sqlstate", None) == "55P03"  # lock_not_available


def _locked(session: Session) -> bool:
    """Take the partitions' advisory lock for this transaction; False if another holds it."""
    session.execute(text(f"SET LOCAL lock_timeout = '{LOCK_TIMEOUT}'"))
    return bool(session.scalar(text("SELECT pg_try_advisory_xact_lock(:key)"), {"key": LOCK_KEY}))


def make_ahead(sessions: sessionmaker[Session], days: int = AHEAD_DAYS) -> list[str]:
    """Make the day partitions from today (the database's clock, UTC) to ``days`` days ahead
    that do not exist yet; returns their names. Rows the default partition holds for such a day
    move into it first. Does nothing while another process holds the lock, or when a table's
    lock could not be had within ``LOCK_TIMEOUT`` (the next pass tries again)."""
    try:
        return _make_ahead(sessions, days)
    except OperationalError as exc:
        if not _lock_timed_out(exc):
            raise
        return []


def _make_ahead(sessions: sessionmaker[Session], days: int) -> list[str]:
    made: list[str] = []
    with sessions.begin() as session:
        if not _locked(session):
            return made
        today = session.scalar(text("SELECT CAST(timezone('UTC', now()) AS date)"))
        assert today is not None
        for history in HISTORY:
            ranges = partitions(session, history.table).values()
            for offset in range(days + 1):
                day = today + dt.timedelta(days=offset)
                start = dt.datetime.combine(day, dt.time(), dt.UTC)
                if not any((low is None or low <= start) and start < end for low, end in ranges):
                    _make(session, history, day)
                    made.append(day_partition(history.table, day))
    return made


def _make(session: Session, history: History, day: dt.date) -> None:
    """Make ``day``'s partition of ``history``: a table of its own, filled with what the default
    partition held of that day, then attached."""
    name = day_partition(history.table, day)
    start, end = _bound(day), _bound(day + dt.timedelta(days=1))
    in_range = f"{history.key} >= '{start}' AND {history.key} < '{end}'"
    session.execute(
        text(f"CREATE TABLE {name} (LIKE {history.table} INCLUDING DEFAULTS INCLUDING CONSTRAINTS)")
    )
    session.execute(
        text(
            f"""WITH moved AS (DELETE FROM {history.table}_default WHERE {in_range} RETURNING *)
            INSERT INTO {name} SELECT * FROM moved"""
        )
    )
    session.execute(
        text(
            f"ALTER TABLE {history.table} ATTACH PARTITION {name}"
            f" FOR VALUES FROM ('{start}') TO ('{end}')"
        )
    )


@dataclass(frozen=True)
class Dropped:
    """What dropping partitions did: rows gone and partitions dropped, by table."""

    rows: dict[str, int]
    partitions: int


def drop_older(sessions: sessionmaker[Session], older_than: dt.timedelta) -> Dropped:
    """Drop every partition whose range ended before the cutoff (``older_than`` ago by the
    database's clock), one transaction each. The rows of it that a run not finished before the
    cutoff needs move to the default partition first, keeping their ids and times."""
    rows = {history.table: 0 for history in HISTORY}
    dropped = 0
    for history in HISTORY:
        with sessions() as session:
            cutoff = session.scalar(text("SELECT now() - :age"), {"age": older_than})
            ranges = partitions(session, history.table)
        assert cutoff is not None
        for name in sorted(n for n, (_, end) in ranges.items() if end <= cutoff):
            try:
                with sessions.begin() as session:
                    if not _locked(session):
                        return Dropped(rows, dropped)
                    if session.scalar(text("SELECT to_regclass(:name)"), {"name": name}) is None:
                        continue  # another process dropped it since it was listed
                    rows[history.table] += _drop(session, history, name, older_than)
            except OperationalError as exc:
                if not _lock_timed_out(exc):
                    raise
                return Dropped(rows, dropped)  # the next pass tries again
            dropped += 1
    return Dropped(rows, dropped)


def _drop(session: Session, history: History, name: str, older_than: dt.timedelta) -> int:
    """Drop the partition ``name`` of ``history``, keeping what unfinished runs need; returns
    the number of rows that went. The partition is read (and its rows kept aside) before the
    parent is locked, so that the parent's exclusive lock lasts only for the detach, the move
    of the kept rows and the drop."""
    session.execute(text(f"LOCK TABLE {name} IN SHARE MODE"))
    total = session.scalar(text(f"SELECT count(*) FROM {name}")) or 0
    session.execute(
        text(
            f"""CREATE TEMPORARY TABLE kept ON COMMIT DROP AS
            SELECT * FROM {name} h WHERE {history.needed}"""
        ),
        {"age": older_than},
    )
    session.execute(text(f"ALTER TABLE {history.table} DETACH PARTITION {name}"))
    kept = session.execute(text(f"INSERT INTO {history.table} SELECT * FROM kept"))
    session.execute(text(f"DROP TABLE {name}"))
    return int(total) - int(kept.rowcount)  # type: ignore[attr-defined]
