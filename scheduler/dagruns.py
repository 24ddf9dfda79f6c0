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
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

from sqlalchemy import Select, func, or_, select, update
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.orm import Session

from deferral.authoring.schedules import latest_automated_intervals
from deferral.dag import DAG
from deferral.loading.dagbag import FolderContents
from deferral.states import DagRunState, DagRunType
from deferral.store import transitions
from deferral.store.tables import Dag, DagRun
from deferral.store.transitions import NewDagRun
from deferral.timetables import DagRunInfo, DataInterval

log = logging.getLogger("deferral.scheduler")

# DAGs whose runs are created per call: one replica never takes every due DAG at once.
DUE_DAGS_PER_CALL = 100
# A DAG row made for a DAG nobody parsed yet (``dags pause``) gets this until it is parsed.
DEFAULT_MAX_ACTIVE_RUNS = 16


# -- pure decisions ----------------------------------------------------------------------------


def runs_to_create(
    dag: DAG, last: DataInterval | None, active: int, now: dt.datetime
) -> tuple[list[DagRunInfo], DagRunInfo | None]:
    """The runs of ``dag`` due by ``now`` after the latest automated run ``last``, no more than
    ``max_active_runs`` allows beside the ``active`` (queued or running) ones; and the run that
    comes after them (None: no more runs)."""
    due: list[DagRunInfo] = []
    info = dag.next_dagrun_info(last, now=now)
    while (
        info is not None
        and info.run_after <= now
        and active + len(due) < dag.max_active_runs
        and (not due or info.logical_date > due[-1].logical_date)
    ):
        due.append(info)
        info = dag.next_dagrun_info(info.data_interval, now=now)
    return due, info


@dataclass(frozen=True)
class QueuedRun:
    id: int
    dag_id: str
    max_active_runs: int


def runs_to_start(queued: Sequence[QueuedRun], running: Mapping[str, int]) -> list[int]:
    """Which queued runs (oldest first) may start now: a DAG never has more than its
    ``max_active_runs`` running, ``running`` being how many each has now."""
    counts = dict(running)
    chosen: list[int] = []
    for run in queued:
        if counts.get(run.dag_id, 0) < run.max_active_runs:
            counts[run.dag_id] = counts.get(run.dag_id, 0) + 1
            chosen.append(run.id)
    return chosen


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

_ACTIVE_RUNS = (
    select(func.count())
    .where(
        DagRun.dag_id == Dag.dag_id,
        DagRun.state.in_((DagRunState.QUEUED, DagRunState.RUNNING)),
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
    due = [(row, active) for row, active in rows if row.dag_id in dags]
    if not due:
        return []
    latest = latest_automated_intervals(session, [row.dag_id for row, _ in due])
    wanted: list[NewDagRun] = []
    for row, active in due:
        dag = dags[row.dag_id]
        infos, following = runs_to_create(dag, latest.get(row.dag_id), active, now)
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
    for run in created:
        log.info(
            "created run %s of DAG %s (data interval %s to %s)",
            run.run_id,
            run.dag_id,
            run.data_interval_start.isoformat(),
            run.data_interval_end.isoformat(),
        )
    return created


def startable_runs(session: Session, limit: int) -> list[DagRun]:
    """Queued runs that may start now, oldest logical date first, locked (``FOR UPDATE``) for
    the caller to start in this transaction: none of a paused DAG (backfill runs excepted, as
    ``airflow dags backfill`` runs paused DAGs) and never more than a DAG's ``max_active_runs``
    running. The DAG rows are locked too, so replicas cannot both start a DAG's last slot."""
    # Running runs counted once per DAG that has queued runs, not once per queued run: a
    # correlated count per row grew with queued times running runs, seconds a loop at scale.
    running = (
        select(DagRun.dag_id, func.count().label("count"))
        .where(
            DagRun.state == DagRunState.RUNNING,
            DagRun.dag_id.in_(select(DagRun.dag_id).where(DagRun.state == DagRunState.QUEUED)),
        )
        .group_by(DagRun.dag_id)
        .subquery("running")
    )
    found = session.execute(
        select(DagRun, Dag.max_active_runs)
        .outerjoin(Dag, Dag.dag_id == DagRun.dag_id)
        .outerjoin(running, running.c.dag_id == DagRun.dag_id)
        .where(
            DagRun.state == DagRunState.QUEUED,
            or_(
                Dag.dag_id.is_(None),
                Dag.is_paused.is_(False),
                DagRun.run_type == DagRunType.BACKFILL,
            ),
            or_(Dag.dag_id.is_(None), Dag.max_active_runs > func.coalesce(running.c.count, 0)),
        )
        .order_by(DagRun.logical_date, DagRun.id)
        .limit(limit)
        .with_for_update(of=DagRun, skip_locked=True)
    ).all()
    if not found:
        return []
    dag_ids = sorted({run.dag_id for run, _ in found})
    locked = set(
        session.scalars(
            select(Dag.dag_id)
            .where(Dag.dag_id.in_(dag_ids))
            .order_by(Dag.dag_id)
            .with_for_update(skip_locked=True)
        )
    )
    # A DAG whose row another replica holds is left to it this time (no row: nothing to hold).
    candidates = [(r, most) for r, most in found if most is None or r.dag_id in locked]
    now_running = {
        dag_id: count
        for dag_id, count in session.execute(
            select(DagRun.dag_id, func.count())
            .where(DagRun.dag_id.in_(dag_ids), DagRun.state == DagRunState.RUNNING)
            .group_by(DagRun.dag_id)
        )
    }
    queued = [
        QueuedRun(run.id, run.dag_id, DEFAULT_MAX_ACTIVE_RUNS if most is None else most)
        for run, most in candidates
    ]
    chosen = set(runs_to_start(queued, now_running))
    return [run for run, _ in candidates if run.id in chosen]


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
