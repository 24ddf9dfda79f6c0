"""Pruning history that nothing needs any more, in bounded batches.

What goes: outbox rows published longer ago than the cutoff; resume events received before it,
unless their task belongs to a run that is still queued or running; state changes and task logs
of runs that finished before it; then those runs themselves, with their task instances, XComs,
rendered fields and reschedules, except each DAG's latest scheduled or backfill run (the
schedule's next run is computed from it); and the rows of schedulers, workers and triggerers
that stopped heartbeating before the cutoff (never less than ``PROCESS_FLOOR`` ago, so a live
process is never pruned whatever the age asked); asset events older than the cutoff that no
DAG still waits for (a watcher's key pruned so may be recorded again). What a running run needs
(its tasks' history, its dedup keys) stays. Each batch is its own short transaction, so pruning
never holds locks for long; a run's rows go before the run, each table in its own batches, so no
single delete cascades over a whole history.

The history tables (``task_state_change``, ``task_log``, ``resume_event``) are partitioned by
day: their days older than the cutoff are dropped as whole partitions, with no row deleted, once
what unfinished runs need of them has moved to the default partition
(``deferral.store.partitions``);
only the default partition's rows are deleted one by one.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
from dataclasses import dataclass

from sqlalchemy import text
from sqlalchemy.orm import Session, sessionmaker

from deferral.states import AUTOMATED_RUN_TYPES
from deferral.store import partitions

# A process row is pruned only once its heartbeat is at least this old, whatever the age asked:
# a live process heartbeats every few seconds (and its next heartbeat would insert it again).
PROCESS_FLOOR = dt.timedelta(minutes=10)
_AUTOMATED = ", ".join(f"'{t}'" for t in sorted(AUTOMATED_RUN_TYPES))
# A run (``dr``) whose rows go: finished before the cutoff, and not its DAG's latest scheduled or
# backfill run (the next run of the schedule follows that one's data interval).
_PRUNABLE_RUN = f"""dr.state IN ('success', 'failed') AND dr.end_date < now() - :age
      AND NOT (dr.run_type IN ({_AUTOMATED}) AND NOT EXISTS (
        SELECT 1 FROM dag_run newer
        WHERE newer.dag_id = dr.dag_id AND newer.run_type IN ({_AUTOMATED})
          AND newer.logical_date > dr.logical_date))"""
_OF_PRUNABLE_RUN = f"""
    JOIN dag_run dr ON dr.dag_id = ti.dag_id AND dr.run_id = ti.run_id
    WHERE {_PRUNABLE_RUN}"""

# The end of a query over task instances (``ti``): only those of runs that finished before the
# cutoff.
_FINISHED_RUN_BEFORE_CUTOFF = """
    JOIN dag_run dr ON dr.dag_id = ti.dag_id AND dr.run_id = ti.run_id
    WHERE dr.state IN ('success', 'failed') AND dr.end_date < now() - :age"""


def _batch_delete(table: str, key: str, batch: str) -> str:
    """Delete the rows of ``table`` whose ``key`` the query ``batch`` (ending ``LIMIT :batch``)
    picks, the batch chosen once in a materialized CTE: written as ``DELETE … WHERE key IN
    (batch)``, the subquery as a semi join's inner side can be planned to run again for every row
    of ``table`` when the statistics say it is nearly empty, as they do after a bulk delete
    (deferral rule 113)."""
    return (
        f"WITH batch AS MATERIALIZED ({batch})"
        f" DELETE FROM {table} WHERE {key} IN (SELECT * FROM batch)"
    )


def _of_prunable_runs(table: str, *key: str) -> str:
    """Delete a batch of ``table``'s rows (primary key ``key``) of prunable runs' tasks."""
    return _batch_delete(
        table,
        f"({', '.join(key)})",
        f"""
            SELECT {", ".join(f"r.{k}" for k in key)} FROM {table} r
            JOIN task_instance ti ON ti.id = r.task_instance_id
            {_OF_PRUNABLE_RUN}
            LIMIT :batch""",
    )


# Each table's batch delete, in the order they run.
STATEMENTS = {
    "outbox": _batch_delete(
        "outbox",
        "id",
        """
            SELECT id FROM outbox
            WHERE published_at IS NOT NULL AND published_at < now() - :age
            LIMIT :batch""",
    ),
    # The history tables are partitioned by day: their old partitions are dropped whole
    # (deferral.store.partitions) and only the rows of the partitions that are not one day's
    # ({partition}: the default one, the one 0014 made of the table as it was) are deleted here.
    "resume_event": _batch_delete(
        "{partition}",
        "dedup_key",
        """
            SELECT re.dedup_key FROM {partition} re
            WHERE re.received_at < now() - :age
              AND NOT EXISTS (
                SELECT 1 FROM task_instance ti
                JOIN dag_run dr ON dr.dag_id = ti.dag_id AND dr.run_id = ti.run_id
                WHERE ti.id = re.task_instance_id AND dr.state IN ('queued', 'running'))
            LIMIT :batch""",
    ),
    "task_state_change": _batch_delete(
        "{partition}",
        "id",
        f"""
            SELECT tsc.id FROM {{partition}} tsc
            JOIN task_instance ti ON ti.id = tsc.task_instance_id
            {_FINISHED_RUN_BEFORE_CUTOFF}
            LIMIT :batch""",
    ),
    "task_log": _batch_delete(
        "{partition}",
        "id",
        f"""
            SELECT tl.id FROM {{partition}} tl
            JOIN task_instance ti ON ti.id = tl.task_instance_id
            {_FINISHED_RUN_BEFORE_CUTOFF}
            LIMIT :batch""",
    ),
    # After the lines: a try's size row goes once the try has no line left.
    "task_log_try": _batch_delete(
        "task_log_try",
        "(task_instance_id, try_number)",
        f"""
            SELECT tlt.task_instance_id, tlt.try_number FROM task_log_try tlt
            JOIN task_instance ti ON ti.id = tlt.task_instance_id
            {_FINISHED_RUN_BEFORE_CUTOFF}
            LIMIT :batch""",
    ),
    # Then the runs themselves: what hangs off their task instances first, table by table.
    "xcom": _of_prunable_runs("xcom", "task_instance_id", "key"),
    "rendered_fields": _of_prunable_runs(
        "rendered_task_instance_fields", "task_instance_id", "try_number"
    ),
    "task_reschedule": _of_prunable_runs("task_reschedule", "id"),
    "task_instance": _batch_delete(
        "task_instance",
        "id",
        f"""
            SELECT ti.id FROM task_instance ti
            {_OF_PRUNABLE_RUN}
            LIMIT :batch""",
    ),
    "dag_run": _batch_delete(
        "dag_run",
        "id",
        f"""
            SELECT dr.id FROM dag_run dr
            WHERE {_PRUNABLE_RUN}
              AND NOT EXISTS (
                SELECT 1 FROM task_instance ti
                WHERE ti.dag_id = dr.dag_id AND ti.run_id = dr.run_id)
            LIMIT :batch""",
    ),
    # Asset events no DAG still waits for (the runs that consumed them may outlive them).
    "asset_event": _batch_delete(
        "asset_event",
        "id",
        """
            SELECT e.id FROM asset_event e
            WHERE e.timestamp < now() - :age
              AND NOT EXISTS (SELECT 1 FROM asset_dag_run_queue q WHERE q.asset_event_id = e.id)
            LIMIT :batch""",
    ),
    # Then their links to the aliases they were added through.
    "asset_alias_event": _batch_delete(
        "asset_alias_event",
        "(alias_name, asset_event_id)",
        """
            SELECT l.alias_name, l.asset_event_id FROM asset_alias_event l
            WHERE NOT EXISTS (SELECT 1 FROM asset_event e WHERE e.id = l.asset_event_id)
            LIMIT :batch""",
    ),
    **{
        table: _batch_delete(
            table,
            "name",
            f"""
            SELECT name FROM {table}
            WHERE latest_heartbeat < now() - GREATEST(CAST(:age AS interval), :floor)
            LIMIT :batch""",
        )
        for table in ("scheduler", "worker", "triggerer")
    },
}


@dataclass(frozen=True)
class Pruned:
    outbox: int
    resume_event: int
    task_state_change: int
    task_log: int
    task_log_try: int
    xcom: int
    rendered_fields: int
    task_reschedule: int
    task_instance: int
    dag_run: int
    asset_event: int
    asset_alias_event: int
    scheduler: int
    worker: int
    triggerer: int
    partitions: int = 0  # of the history tables, dropped whole

    @property
    def total(self) -> int:
        return sum(dataclasses.astuple(self))

    def describe(self) -> str:
        """What went, for people: "pruned 1 outbox row(s), ..."."""
        return (
            f"pruned {self.outbox} outbox row(s), {self.resume_event} resume event(s),"
            f" {self.task_state_change} state change(s), {self.task_log} task log line(s),"
            f" {self.dag_run} run(s) with {self.task_instance} task instance(s) and"
            f" {self.xcom} XCom(s), {self.scheduler + self.worker + self.triggerer} stopped"
            f" process row(s), {self.partitions} history partition(s) dropped"
        )


def _delete(
    sessions: sessionmaker[Session], statement: str, older_than: dt.timedelta, batch_size: int
) -> int:
    """Run the batch delete ``statement`` until it deletes less than a batch; returns the rows
    deleted."""
    total = 0
    while True:
        with sessions.begin() as session:
            result = session.execute(
                text(statement), {"age": older_than, "batch": batch_size, "floor": PROCESS_FLOOR}
            )
            deleted = int(result.rowcount)  # type: ignore[attr-defined]
        total += deleted
        if deleted < batch_size:
            return total


def prune(
    sessions: sessionmaker[Session], older_than: dt.timedelta, batch_size: int = 5000
) -> Pruned:
    """Drop the history partitions and delete the rows older than ``older_than`` (by the
    database's clock), batch by batch. The cutoff is taken back to the start of its UTC day, the
    history tables' partition boundary, so that a run goes with its history's partitions (a
    deleted run's task instances would otherwise cascade into a partition kept)."""
    with sessions() as session:
        older_than = session.scalar(
            text("SELECT now() - date_trunc('day', now() - :age, 'UTC')"), {"age": older_than}
        )
    assert older_than is not None
    dropped = partitions.drop_older(sessions, older_than)
    counts: dict[str, int] = {}
    for table, statement in STATEMENTS.items():
        counts[table] = 0
        if table not in dropped.rows:
            counts[table] = _delete(sessions, statement, older_than, batch_size)
            continue
        with sessions() as session:
            catch_alls = partitions.catch_alls(session, table)
        for partition in catch_alls:
            counts[table] += _delete(
                sessions, statement.format(partition=partition), older_than, batch_size
            )
    for table, rows in dropped.rows.items():
        counts[table] += rows
    return Pruned(**counts, partitions=dropped.partitions)
