"""Progress a trigger reports before its event (``TriggerProgress``): recorded per try of each
task waiting on the trigger, the last :data:`KEPT` kept, numbered from 1 so that the highest
number less the rows kept is how many were dropped. Payloads stay sealed (as the triggerer
sealed them) until shown."""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import text
from sqlalchemy.orm import Session

from deferral.runtime.crypto import Cipher, DecryptionError, Purpose

# Reports kept per try: enough to show how a wait went (the last steps of a job), bounded so
# that a trigger reporting every second for days costs its task a fixed number of rows.
KEPT = 20

# The tasks deferred on these triggers, locked (as a resume locks them) so that two reports on
# one task are numbered in turn; then, in a statement of its own (its snapshot sees what the
# lock's last holder recorded), each report numbered on from the try's last and inserted.
_LOCK_SQL = text(
    "SELECT id FROM task_instance WHERE trigger_id = ANY(CAST(:trigger_ids AS bigint[]))"
    " AND state = 'deferred' ORDER BY id FOR UPDATE"
)
_RECORD_SQL = text(
    """
    WITH reports AS (
        SELECT * FROM unnest(CAST(:trigger_ids AS bigint[]), CAST(:payloads AS text[]))
            WITH ORDINALITY AS r (trigger_id, payload, n)
    ), waiting AS (
        SELECT ti.id, ti.try_number, ti.trigger_id,
            COALESCE((SELECT max(p.seq) FROM trigger_progress AS p
                      WHERE p.task_instance_id = ti.id AND p.try_number = ti.try_number), 0)
                AS last
        FROM task_instance AS ti
        WHERE ti.trigger_id = ANY(CAST(:trigger_ids AS bigint[])) AND ti.state = 'deferred'
    ), recorded AS (
        INSERT INTO trigger_progress (task_instance_id, try_number, seq, payload)
        SELECT w.id, w.try_number,
            w.last + row_number() OVER (PARTITION BY w.id ORDER BY r.n), r.payload
        FROM reports AS r JOIN waiting AS w ON w.trigger_id = r.trigger_id
        RETURNING task_instance_id, try_number, seq
    )
    SELECT task_instance_id, try_number, max(seq) AS top, count(*) AS recorded FROM recorded
    GROUP BY task_instance_id, try_number
    """
)
# Each try's reports but the last :kept (a statement of its own: it sees what was just
# inserted).
_TRIM_SQL = text(
    """
    DELETE FROM trigger_progress AS p
    USING unnest(CAST(:ids AS bigint[]), CAST(:tries AS integer[]), CAST(:tops AS integer[]))
        AS t (task_instance_id, try_number, top)
    WHERE p.task_instance_id = t.task_instance_id AND p.try_number = t.try_number
        AND p.seq <= t.top - :kept
    """
)


def record(session: Session, reports: Sequence[tuple[int, str]]) -> int:
    """Record progress reports (trigger id, sealed payload), in order, for every task deferred
    on each trigger, keeping the last :data:`KEPT` of each try. Returns the rows recorded
    (a report whose trigger no task waits on any more records nothing)."""
    if not reports:
        return 0
    trigger_ids = [trigger_id for trigger_id, _ in reports]
    session.execute(_LOCK_SQL, {"trigger_ids": sorted(set(trigger_ids))})
    tries = session.execute(
        _RECORD_SQL, {"trigger_ids": trigger_ids, "payloads": [p for _, p in reports]}
    ).all()
    over = [t for t in tries if t.top > KEPT]
    if over:
        session.execute(
            _TRIM_SQL,
            {
                "ids": [t.task_instance_id for t in over],
                "tries": [t.try_number for t in over],
                "tops": [t.top for t in over],
                "kept": KEPT,
            },
        )
    return sum(t.recorded for t in tries)


@dataclass(frozen=True)
class Report:
    """One recorded report: its number in the try, when it was recorded, its payload."""

    seq: int
    at: dt.datetime
    payload: Any  # None if it no longer opens (a key retired)


@dataclass(frozen=True)
class Reports:
    """A try's recorded progress: the reports kept (oldest first), and how many were dropped."""

    kept: list[Report]
    dropped: int

    @property
    def total(self) -> int:
        return self.dropped + len(self.kept)


_READ_SQL = text(
    "SELECT seq, recorded_at, payload FROM trigger_progress"
    " WHERE task_instance_id = :id AND try_number = :try_number ORDER BY seq"
)


def of_try(session: Session, cipher: Cipher, task_instance_id: int, try_number: int) -> Reports:
    """The progress recorded for try ``try_number`` of ``task_instance_id``."""
    rows = session.execute(_READ_SQL, {"id": task_instance_id, "try_number": try_number}).all()
    kept = []
    for row in rows:
        try:
            payload = cipher.open(Purpose.EVENT, row.payload)
        except DecryptionError:
            payload = None
        kept.append(Report(row.seq, row.recorded_at, payload))
    dropped = rows[-1].seq - len(rows) if rows else 0
    return Reports(kept, dropped)
