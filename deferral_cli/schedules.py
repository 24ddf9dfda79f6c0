"""``deferral dags pause|unpause|backfill|next-run``: a DAG's schedule from the command line."""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterator, Sequence
from typing import TypeVar

import click
from sqlalchemy import select
from sqlalchemy.orm import Session

from deferral.authoring.schedules import Schedulable, next_run
from deferral.runtime.process import settings_or_exit
from deferral.states import DagRunType
from deferral.store import actions, transitions
from deferral.store.tables import Dag, DagRun
from deferral.store.transitions import NewDagRun
from deferral.timetables import DagRunInfo, infos_between
from deferral_cli.common import DateTimeParam, fail, load_dag, sessions, stored_dag, when

# Backfill runs are inserted this many per statement.
BACKFILL_BATCH = 1000

T = TypeVar("T")


def _batches(items: Sequence[T]) -> Iterator[list[T]]:
    for first in range(0, len(items), BACKFILL_BATCH):
        yield list(items[first : first + BACKFILL_BATCH])


def _set_paused(dag_id: str, paused: bool) -> None:
    settings = settings_or_exit()
    actions.set_paused(sessions(settings), stored_dag(settings, dag_id), paused)
    click.echo(f"DAG {dag_id} {'paused' if paused else 'unpaused'}")


@click.command("pause")
@click.argument("dag_id")
def dags_pause(dag_id: str) -> None:
    """Pause DAG_ID: the scheduler creates no run and starts no queued run of it (backfill runs
    excepted) until it is unpaused."""
    _set_paused(dag_id, True)


@click.command("unpause")
@click.argument("dag_id")
def dags_unpause(dag_id: str) -> None:
    """Unpause DAG_ID: its schedule resumes (with catchup=False, from the latest interval)."""
    _set_paused(dag_id, False)


def _interval(info: DagRunInfo) -> str:
    return f"{when(info.data_interval.start)} to {when(info.data_interval.end)}"


@click.command("backfill")
@click.argument("dag_id")
@click.option("-s", "--start-date", type=DateTimeParam(), required=True, help="First date.")
@click.option("-e", "--end-date", type=DateTimeParam(), required=True, help="Last date.")
@click.option("--dry-run", is_flag=True, help="List the runs without creating them.")
def dags_backfill(
    dag_id: str, start_date: dt.datetime, end_date: dt.datetime, dry_run: bool
) -> None:
    """Create a backfill run of DAG_ID for every schedule interval whose logical date falls
    between START_DATE and END_DATE (both included). Dates that already have a run are skipped;
    the scheduler starts the new runs, max_active_runs at a time, even if the DAG is paused."""
    if end_date < start_date:
        fail(f"--end-date {when(end_date)} is before --start-date {when(start_date)}")
    settings = settings_or_exit()
    # The timetable the document keeps; one of the DAG file's own is made by its file alone.
    timetable = stored_dag(settings, dag_id).rebuilt_timetable()
    if timetable is None:
        timetable = load_dag(settings, dag_id).timetable
    if not timetable.can_be_scheduled:
        fail(f"DAG {dag_id!r} has schedule=None: there is nothing to backfill")
    infos = infos_between(timetable, start_date, end_date)
    if not infos:
        fail(f"DAG {dag_id!r} has no schedule interval between those dates")
    runs = [
        NewDagRun(
            dag_id=dag_id,
            run_type=DagRunType.BACKFILL,
            logical_date=info.logical_date,
            data_interval_start=info.data_interval.start,
            data_interval_end=info.data_interval.end,
        )
        for info in infos
    ]
    with sessions(settings).begin() as session:
        existing = _existing_logical_dates(session, dag_id, [r.logical_date for r in runs])
        created: set[str] = set()
        if not dry_run:
            for batch in _batches(runs):
                created.update(transitions.create_dag_runs_once(session, batch))
    for run, info in zip(runs, infos, strict=True):
        if run.logical_date in existing:
            click.echo(f"skipped {when(run.logical_date)}: a run has this logical date already")
        elif dry_run or run.run_id in created:
            verb = "would create" if dry_run else "created"
            click.echo(f"{verb} {run.run_id} (data interval {_interval(info)})")
    count = len(runs) - len(existing) if dry_run else len(created)
    done = "would be created" if dry_run else "created"
    click.echo(f"{count} backfill run(s) {done}, {len(existing)} skipped")


def _existing_logical_dates(
    session: Session, dag_id: str, dates: Sequence[dt.datetime]
) -> set[dt.datetime]:
    found: set[dt.datetime] = set()
    for batch in _batches(dates):
        found.update(
            session.scalars(
                select(DagRun.logical_date).where(
                    DagRun.dag_id == dag_id, DagRun.logical_date.in_(batch)
                )
            )
        )
    return found


@click.command("next-run")
@click.argument("dag_id")
def dags_next_run(dag_id: str) -> None:
    """Show the next run the scheduler will create for DAG_ID: its logical date, its data
    interval, and the moment after which it is created."""
    settings = settings_or_exit()
    stored = stored_dag(settings, dag_id)
    # The document's timetable; one of the DAG file's own is made by its file alone.
    timetable = stored.rebuilt_timetable()
    dag: Schedulable = stored
    if timetable is None:
        dag = load_dag(settings, dag_id)
        timetable = dag.timetable
    with sessions(settings)() as session:
        info = next_run(session, dag, dt.datetime.now(dt.UTC))
        row = session.get(Dag, dag_id)
    if info is None:
        why = "schedule=None" if not timetable.can_be_scheduled else "no interval is left"
        click.echo(f"no next run: {why}")
        return
    click.echo(f"logical date: {when(info.logical_date)}")
    click.echo(f"data interval: {_interval(info)}")
    click.echo(f"created after: {when(info.run_after)}")
    if row is not None and row.is_paused:
        click.echo(f"(paused: no run is created until `deferral dags unpause {dag_id}`)")
