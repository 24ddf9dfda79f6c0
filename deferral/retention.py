"""Pruning history that nothing needs any more, in bounded batches.

What goes: outbox rows published longer ago than the cutoff; resume events received before it,
unless their task belongs to a run that is still queued or running; state changes and task logs
of runs that finished before it. What a running run needs (its tasks' history, its dedup keys)
stays. Each batch is its own short transaction, so pruning never holds locks for long.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
from dataclasses import dataclass

from sqlalchemy import text
from sqlalchemy.orm import Session, sessionmaker

# The end of a query over task instances (``ti``): only those of runs that finished before the
# cutoff.
_FINISHED_RUN_BEFORE_CUTOFF = """
    JOIN dag_run dr ON dr.dag_id = ti.dag_id AND dr.run_id = ti.run_id
    WHERE dr.state IN ('success', 'failed') AND dr.end_date < now() - :age"""

_STATEMENTS = {
    "outbox": """
        DELETE FROM outbox WHERE id IN (
            SELECT id FROM outbox
            WHERE published_at IS NOT NULL AND published_at < now() - :age
            LIMIT :batch)
    """,
    "resume_event": """
        DELETE FROM resume_event WHERE dedup_key IN (
            SELECT re.dedup_key FROM resume_event re
            WHERE re.received_at < now() - :age
              AND NOT EXISTS (
                SELECT 1 FROM task_instance ti
                JOIN dag_run dr ON dr.dag_id = ti.dag_id AND dr.run_id = ti.run_id
                WHERE ti.id = re.task_instance_id AND dr.state IN ('queued', 'running'))
            LIMIT :batch)
    """,
    "task_state_change": f"""
        DELETE FROM task_state_change WHERE id IN (
            SELECT tsc.id FROM task_state_change tsc
            JOIN task_instance ti ON ti.id = tsc.task_instance_id
            {_FINISHED_RUN_BEFORE_CUTOFF}
            LIMIT :batch)
    """,
    "task_log": f"""
        DELETE FROM task_log WHERE id IN (
            SELECT tl.id FROM task_log tl
            JOIN task_instance ti ON ti.id = tl.task_instance_id
            {_FINISHED_RUN_BEFORE_CUTOFF}
            LIMIT :batch)
    """,
    # After the lines: a try's size row goes once the try has no line left.
    "task_log_try": f"""
        DELETE FROM task_log_try WHERE (task_instance_id, try_number) IN (
            SELECT tlt.task_instance_id, tlt.try_number FROM task_log_try tlt
            JOIN task_instance ti ON ti.id = tlt.task_instance_id
            {_FINISHED_RUN_BEFORE_CUTOFF}
            LIMIT :batch)
    """,
}


@dataclass(frozen=True)
class Pruned:
    outbox: int
    resume_event: int
    task_state_change: int
    task_log: int
    task_log_try: int

    @property
    def total(self) -> int:
        return sum(dataclasses.astuple(self))

    def describe(self) -> str:
        """What went, for people: "pruned 1 outbox row(s), ..."."""
        return (
            f"pruned {self.outbox} outbox row(s), {self.resume_event} resume event(s),"
            f" {self.task_state_change} state change(s), {self.task_log} task log line(s)"
        )


def prune(
    sessions: sessionmaker[Session], older_than: dt.timedelta, batch_size: int = 5000
) -> Pruned:
    """Delete what is older than ``older_than`` (by the database's clock), batch by batch."""
    counts: dict[str, int] = {}
    for table, statement in _STATEMENTS.items():
        counts[table] = 0
        while True:
            with sessions.begin() as session:
                result = session.execute(text(statement), {"age": older_than, "batch": batch_size})
                deleted = result.rowcount  # type: ignore[attr-defined]
            counts[table] += deleted
            if deleted < batch_size:
                break
    return Pruned(**counts)
