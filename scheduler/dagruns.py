"""Scheduled DAG runs: what the ``dag`` rows say of each parsed DAG's schedule, the runs the
scheduler creates when their data interval has ended, which queued runs may start under
``max_active_runs``, and runs past their ``dagrun_timeout``.

Several scheduler replicas may call all of this at once. A scheduled run is created exactly once
because ``dag_run`` has one row per (dag_id, logical_date) and runs are inserted with
``ON CONFLICT DO NOTHING``; the ``dag`` row locks taken here (``SKIP LOCKED``) only keep two
replicas from doing the same work at the same moment, and are held for one transaction.
"""

from __future__ import annotations

import datetime as dt
import logging
from collections.abc import Collection, Mapping
from dataclasses import dataclass

from sqlalchemy import Select, func, or_, select, text, update
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.orm import Session

from deferral.authoring.schedules import latest_automated_intervals
from deferral.dag import DAG
from deferral.loading.dagbag import FolderContents
from deferral.states import DagRunState, DagRunType
from deferral.store import transitions
from deferral.store.tables import Dag, DagRun, DagRunCount
from deferral.store.transitions import NewDagRun
from deferral.timetables import DagRunInfo, DataInterval

log = logging.getLogger("deferral.scheduler")

# DAGs whose runs are created per call: one replica never takes every due DAG at once.
DUE_DAGS_PER_CALL = 100
# Runs of one DAG created per call: a catch-up of 20,000 intervals is created a thousand at a
# time, started and evaluated meanwhile, rather than held up for one transaction of 20,000
# (a timetable step in Python each; scheduler/DECISIONS.md 38).
RUNS_PER_DAG_CALL = 1000
# A DAG row made for a DAG nobody parsed yet (``dags pause``) gets this until it is parsed.
DEFAULT_MAX_ACTIVE_RUNS = 16


# -- pure decisions ----------------------------------------------------------------------------


def runs_to_create(
    dag: DAG,
    last: DataInterval | None,
    active: int,
    now: dt.datetime,
    at_most: int = RUNS_PER_DAG_CALL,
) -> tuple[list[DagRunInfo], DagRunInfo | None]:
    """The runs of ``dag`` due by ``now`` after the latest automated run ``last``, no more than
    ``max_active_runs`` allows beside the ``active`` (queued or running) ones, nor ``at_most``;
    and the run that comes after them (None: no more runs)."""
    due: list[DagRunInfo] = []
    info = dag.next_dagrun_info(last, now=now)
    while (
        info is not None
        and info.run_after <= now
        and len(due) < at_most
        and active + len(due) < dag.max_active_runs
        and (not due or info.logical_date > due[-1].logical_date)
    ):
        due.append(info)
        info = dag.next_dagrun_info(info.data_interval, now=now)
    return due, info


@dataclass(frozen=True)
class QueuedDag:
    """A DAG with queued runs: its limit (None: no row yet), whether it is paused, and how
    many of its runs are running."""

    dag_id: str
    max_active_runs: int | None
    paused: bool
    running: int

    def room(self) -> int:
        """How many of its queued runs may start now."""
        most = DEFAULT_MAX_ACTIVE_RUNS if self.max_active_runs is None else self.max_active_runs
        return max(0, most - self.running)


def timed_out(start_date: dt.datetime, timeout: dt.timedelta, now: dt.datetime) -> bool:
    return start_date < now - timeout


# -- after each parse: what the dag rows say about schedules ------------------------------------


def sync_dags(
    session: Session, dagbag: FolderContents, now: dt.datetime, pending: Collection[str] = ()
) -> None:
    """Record each parsed DAG's schedule in its ``dag`` row: schedule, max_active_runs, tags and
    its next run; a row made now is paused if the DAG says ``is_paused_upon_creation=True``. DAGs no
    file defines any more are deactivated (missing since now, "no longer defined in <file>"),
    but for those of the files ``pending`` (an interim read has not read them yet).

    Runs before ``scheduler.dags.sync`` (which keeps the rows' other columns, ``import_error``,
    and the missing DAGs whose file fails to import), so that it is the one to create rows."""
    dags = dagbag.dags
    latest = latest_automated_intervals(session, list(dags))
    rows = [
        {
            "dag_id": dag_id,
            "fileloc": dag.fileloc,
            "is_paused": bool(dag.is_paused_upon_creation),
            "schedule": (
                dag.timetable.summary
                if dag.timetable.can_be_scheduled or dag.asset_condition is not None
                else None
            ),
            "max_active_tasks": dag.max_active_tasks,
            "max_active_runs": dag.max_active_runs,
            "tags": list(dag.tags),
            **_next_run_columns(dag.next_dagrun_info(latest.get(dag_id), now=now)),
        }
        for dag_id, dag in sorted(dags.items())  # one lock order for every replica
    ]
    if rows:
        insert = pg_insert(Dag).values(rows)
        # is_paused belongs to users once the row exists; the rest is the last parse's.
        kept = {"dag_id", "is_paused", "fileloc", "max_active_tasks"}
        session.execute(
            insert.on_conflict_do_update(
                index_elements=[Dag.dag_id],
                set_={name: insert.excluded[name] for name in rows[0] if name not in kept},
            )
        )
    gone = session.scalars(
        update(Dag)
        .where(
            Dag.dag_id.not_in(sorted(dags)),
            Dag.is_active,
            or_(
                Dag.fileloc.is_(None),
                Dag.fileloc.not_in([*dagbag.import_errors, *pending]),
            ),
        )
        .values(
            is_active=False,
            missing_since=func.coalesce(Dag.missing_since, now),
            missing_reason=func.concat("no longer defined in ", Dag.fileloc),
        )
        .returning(Dag.dag_id)
    ).all()
    for dag_id in gone:
        log.warning("DAG %s is no longer defined in the DAGs folder: deactivated", dag_id)


def _next_run_columns(info: DagRunInfo | None) -> dict[str, dt.datetime | None]:
    return {
        "next_dagrun": info.logical_date if info else None,
        "next_dagrun_data_interval_start": info.data_interval.start if info else None,
        "next_dagrun_data_interval_end": info.data_interval.end if info else None,
        "next_dagrun_create_after": info.run_after if info else None,
    }


# -- scheduled runs ------------------------------------------------------------------------------

# A DAG's queued and running runs as their counts say (dag_run_count): a prefilter only, taken
# before the DAG's row is locked; create_due_runs counts again under the lock.
_ACTIVE_RUNS = (
    select(func.coalesce(func.sum(DagRunCount.delta), 0))
    .where(
        DagRunCount.dag_id == Dag.dag_id,
        DagRunCount.state.in_((DagRunState.QUEUED, DagRunState.RUNNING)),
    )
    .correlate(Dag)
    .scalar_subquery()
)


def due_dags_query(now: dt.datetime, limit: int) -> Select[Dag, int]:
    """Unpaused active DAGs that load, whose next run is due and that are below
    max_active_runs, with their number of active runs; locked, skipping rows another replica
    holds."""
    return (
        select(Dag, _ACTIVE_RUNS)
        .where(
            Dag.next_dagrun_create_after <= now,
            Dag.is_paused.is_(False),
            Dag.is_active.is_(True),
            Dag.missing_since.is_(None),
            Dag.max_active_runs > _ACTIVE_RUNS,
        )
        .order_by(Dag.next_dagrun_create_after)
        .limit(limit)
        .with_for_update(of=Dag, skip_locked=True)
    )


def create_due_runs(
    session: Session, dags: Mapping[str, DAG], now: dt.datetime, limit: int = DUE_DAGS_PER_CALL
) -> list[NewDagRun]:
    """Create the scheduled runs whose data interval has ended by ``now`` (queued), for unpaused
    active DAGs that load and are below ``max_active_runs``; with catchup, every missed interval,
    as many per call as max_active_runs allows. Moves each DAG's next run on. When nothing is
    due this is one query on an index of ``dag``. Returns the runs it created."""
    rows = session.execute(due_dags_query(now, limit)).all()
    # A DAG this replica has not parsed yet is left to one that has.
    due = [row for row, _ in rows if row.dag_id in dags]
    if not due:
        return []
    # Counted in a statement after the one that locked the rows: it sees every run the lock's
    # last holder created or started.
    counts = fold_counts(session, [row.dag_id for row in due])
    active_of = {
        row.dag_id: counts.get((row.dag_id, DagRunState.QUEUED), 0)
        + counts.get((row.dag_id, DagRunState.RUNNING), 0)
        for row in due
    }
    latest = latest_automated_intervals(session, [row.dag_id for row in due])
    wanted: list[NewDagRun] = []
    for row in due:
        dag = dags[row.dag_id]
        infos, following = runs_to_create(dag, latest.get(row.dag_id), active_of[row.dag_id], now)
        wanted += [
            NewDagRun(
                dag_id=dag.dag_id,
                run_type=DagRunType.SCHEDULED,
                logical_date=info.logical_date,
                data_interval_start=info.data_interval.start,
                data_interval_end=info.data_interval.end,
            )
            for info in infos
        ]
        for name, value in _next_run_columns(following).items():
            setattr(row, name, value)
    created_ids = set(transitions.create_dag_runs_once(session, wanted))
    created = [run for run in wanted if run.run_id in created_ids]
    # One line per DAG and call: a catch-up creates thousands of runs at once.
    by_dag: dict[str, list[NewDagRun]] = {}
    for run in created:
        by_dag.setdefault(run.dag_id, []).append(run)
    for dag_id, runs in by_dag.items():
        first, last = runs[0], runs[-1]
        log.info(
            "created %d run(s) of DAG %s, %s to %s (data intervals from %s to %s)",
            len(runs),
            dag_id,
            first.run_id,
            last.run_id,
            first.data_interval_start.isoformat(),
            last.data_interval_end.isoformat(),
        )
    return created


# The DAGs that have queued runs, by a skip scan of ix_dag_run_queued (one index probe per
# DAG, not a read of every queued run), with their row's limits and their running runs as
# their counts say (dag_run_count: summed, not folded, as no lock is held yet).
_QUEUED_DAGS_SQL = text(
    """
    WITH RECURSIVE queued AS (
        (SELECT dag_id FROM dag_run WHERE state = 'queued' ORDER BY dag_id LIMIT 1)
        UNION ALL
        SELECT (SELECT r.dag_id FROM dag_run AS r
                WHERE r.state = 'queued' AND r.dag_id > queued.dag_id
                ORDER BY r.dag_id LIMIT 1)
        FROM queued WHERE queued.dag_id IS NOT NULL
    )
    SELECT queued.dag_id, dag.max_active_runs, dag.is_paused,
           (SELECT coalesce(sum(c.delta), 0) FROM dag_run_count AS c
            WHERE c.dag_id = queued.dag_id AND c.state = 'running') AS running
    FROM queued LEFT JOIN dag ON dag.dag_id = queued.dag_id
    WHERE queued.dag_id IS NOT NULL
    """
)

_LOCK_DAGS_SQL = text(
    "SELECT dag_id FROM dag WHERE dag_id = ANY(CAST(:dag_ids AS text[]))"
    " ORDER BY dag_id FOR UPDATE SKIP LOCKED"
)

# The queued and running runs of these DAGs as their counts say, each (DAG, state)'s rows
# folded into one on the way. Only a holder of the DAGs' row locks may call it: two folds of
# the same rows at once would each see a part of them. Rows other transactions add meanwhile
# are not seen by this statement and stay as they are.
_FOLD_COUNTS_SQL = text(
    """
    WITH gone AS (
        DELETE FROM dag_run_count WHERE dag_id = ANY(CAST(:dag_ids AS text[]))
        RETURNING dag_id, state, delta
    ), sums AS (
        SELECT dag_id, state, CAST(sum(delta) AS integer) AS total FROM gone
        GROUP BY dag_id, state
    ), kept AS (
        INSERT INTO dag_run_count (dag_id, state, delta)
        SELECT dag_id, state, total FROM sums WHERE total <> 0
    )
    SELECT dag_id, state, total FROM sums
    """
)

# Each DAG's oldest queued runs, at most its room (backfill runs only, for a paused DAG),
# then the oldest of those overall; locked, skipping any another replica holds.
_QUEUED_RUNS_SQL = text(
    """
    SELECT run.* FROM unnest(CAST(:dag_ids AS text[]), CAST(:rooms AS integer[]),
                             CAST(:backfill_only AS boolean[])) AS d (dag_id, room, backfill_only)
    CROSS JOIN LATERAL (
        SELECT * FROM dag_run
        WHERE dag_run.dag_id = d.dag_id AND dag_run.state = 'queued'
            AND (NOT d.backfill_only OR dag_run.run_type = 'backfill')
        ORDER BY dag_run.logical_date, dag_run.id
        LIMIT d.room
        FOR UPDATE SKIP LOCKED
    ) AS run
    ORDER BY run.logical_date, run.id
    LIMIT :limit
    """
)


def fold_counts(session: Session, dag_ids: Collection[str]) -> dict[tuple[str, str], int]:
    """The queued and running runs of ``dag_ids`` (whose rows the caller holds locked), by
    (dag_id, state), from their counts; folds each one's rows into one."""
    if not dag_ids:
        return {}
    rows = session.execute(_FOLD_COUNTS_SQL, {"dag_ids": sorted(dag_ids)})
    return {(row.dag_id, row.state): row.total for row in rows}


def startable_runs(session: Session, limit: int) -> list[DagRun]:
    """Queued runs that may start now, oldest logical date first, locked (``FOR UPDATE``) for
    the caller to start in this transaction: none of a paused DAG (backfill runs excepted, as
    ``airflow dags backfill`` runs paused DAGs) and never more than a DAG's ``max_active_runs``
    running. The DAG rows are locked too, so replicas cannot both start a DAG's last slot.

    What it reads grows with the DAGs that have queued runs and with ``limit``, never with the
    runs queued or running: the running runs are counted by ``dag_run_count``."""
    queued = session.execute(_QUEUED_DAGS_SQL).all()
    wanted = [
        QueuedDag(row.dag_id, row.max_active_runs, bool(row.is_paused), row.running)
        for row in queued
    ]
    wanted = [dag for dag in wanted if dag.room() > 0]
    if not wanted:
        return []
    with_row = [dag.dag_id for dag in wanted if dag.max_active_runs is not None]
    locked = set(session.scalars(_LOCK_DAGS_SQL, {"dag_ids": with_row})) if with_row else set()
    # Counted again in a statement after the lock (one that waited for it would not see what
    # the lock's holder started); a DAG whose row another replica holds is left to it.
    counts = fold_counts(session, locked)
    startable = [
        QueuedDag(
            dag.dag_id,
            dag.max_active_runs,
            dag.paused,
            counts.get((dag.dag_id, DagRunState.RUNNING), 0),
        )
        if dag.dag_id in locked
        else dag
        for dag in wanted
        if dag.max_active_runs is None or dag.dag_id in locked
    ]
    startable = [dag for dag in startable if dag.room() > 0]
    if not startable:
        return []
    params = {
        "dag_ids": [dag.dag_id for dag in startable],
        "rooms": [min(dag.room(), limit) for dag in startable],
        "backfill_only": [dag.paused for dag in startable],
        "limit": limit,
    }
    return list(session.scalars(select(DagRun).from_statement(_QUEUED_RUNS_SQL), params))


def fail_timed_out_runs(
    session: Session, dags: Mapping[str, DAG], now: dt.datetime
) -> list[tuple[str, str]]:
    """Fail every running run older than its DAG's ``dagrun_timeout`` (its unfinished tasks are
    skipped, as in Airflow 2); returns their (dag_id, run_id)."""
    timeouts = {dag_id: dag.dagrun_timeout for dag_id, dag in dags.items() if dag.dagrun_timeout}
    if not timeouts:
        return []
    running = session.execute(
        select(DagRun.id, DagRun.dag_id, DagRun.run_id, DagRun.start_date).where(
            DagRun.state == DagRunState.RUNNING,
            DagRun.dag_id.in_(sorted(timeouts)),
            DagRun.start_date < now - min(timeouts.values()),
        )
    ).all()
    failed = []
    for run_pk, dag_id, run_id, start_date in running:
        if start_date is not None and timed_out(start_date, timeouts[dag_id], now):
            skipped = transitions.time_out_dag_run(session, run_pk)
            if skipped is not None:
                log.warning(
                    "run %s of DAG %s failed: dagrun_timeout %s passed (%d task(s) skipped)",
                    run_id,
                    dag_id,
                    timeouts[dag_id],
                    len(skipped),
                )
                failed.append((dag_id, run_id))
    return failed
