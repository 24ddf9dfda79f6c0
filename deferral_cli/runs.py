"""``deferral runs``: a run, its task instances and their history."""

from __future__ import annotations

import click
from sqlalchemy import exists, select
from sqlalchemy.orm import Session

from deferral.runtime.config import Settings
from deferral.runtime.process import command_group, settings_or_exit
from deferral.states import DagRunState
from deferral.store.actions import ti_label
from deferral.store.tables import Dag, DagRun, TaskInstance, TaskStateChange
from deferral_cli.common import (
    dagbag,
    emit,
    fail,
    find_run,
    output_options,
    run_id_argument,
    sessions,
    stamp,
)
from readmodel.records import run_record


@command_group()
def runs() -> None:
    """DAG runs."""


@runs.command("list")
@click.argument("dag_id", required=False)
@click.option(
    "--state",
    type=click.Choice([state.value for state in DagRunState]),
    default=None,
    help="Only runs in this state.",
)
@click.option(
    "--limit", type=click.IntRange(min=1), default=100, show_default=True, help="Most runs listed."
)
@output_options
def runs_list(dag_id: str | None, state: str | None, limit: int, output: str) -> None:
    """List DAG runs (of DAG_ID, if given), newest logical date first."""
    settings = settings_or_exit()
    query = select(DagRun).order_by(DagRun.logical_date.desc(), DagRun.id.desc()).limit(limit)
    if dag_id is not None:
        query = query.where(DagRun.dag_id == dag_id)
    if state is not None:
        query = query.where(DagRun.state == state)
    with sessions(settings)() as session:
        found = session.scalars(query).all()
        known = dag_id is None or found or _dag_known(session, settings, dag_id)
    if not known:
        fail(f"DAG {dag_id!r} not found")
    emit(output, [run_record(run) for run in found], empty="no runs")


def _dag_known(session: Session, settings: Settings, dag_id: str) -> bool:
    if session.scalar(select(exists().where(DagRun.dag_id == dag_id))):
        return True
    return session.get(Dag, dag_id) is not None or dag_id in dagbag(settings).dags


@runs.command("show")
@click.argument("dag_id")
@run_id_argument
@click.option("--history", is_flag=True, help="Also list every state change of every task.")
def runs_show(dag_id: str, run_id: str, history: bool) -> None:
    """Show a run, its task instances and (with --history) their state changes."""
    show_run(settings_or_exit(), dag_id, run_id, history)


def show_run(settings: Settings, dag_id: str, run_id: str, history: bool) -> None:
    with sessions(settings)() as session:
        run = find_run(session, dag_id, run_id)
        if run is None:
            fail(f"DAG {dag_id!r} has no run {run_id!r}")
            return
        click.echo(f"{run.dag_id} {run.run_id}: {run.state} (logical date {run.logical_date})")
        tis = session.scalars(
            select(TaskInstance)
            .where(TaskInstance.dag_id == dag_id, TaskInstance.run_id == run_id)
            .order_by(TaskInstance.id)
        ).all()
        # A mapped task's map indexes together, in order (map index 0 was its placeholder).
        order = {ti.task_id: ti.id for ti in reversed(tis)}
        tis = sorted(tis, key=lambda ti: (order[ti.task_id], ti.map_index))
        for ti in tis:
            waiting = f" waiting on trigger {ti.trigger_id}" if ti.trigger_id else ""
            label = ti_label(ti.task_id, ti.map_index)
            click.echo(f"  {label}: {ti.state} (try {ti.try_number}){waiting}")
            if not history:
                continue
            changes = session.scalars(
                select(TaskStateChange)
                .where(TaskStateChange.task_instance_id == ti.id)
                .order_by(TaskStateChange.id)
            )
            for change in changes:
                click.echo(
                    f"    {stamp(change.at, microseconds=True)} {change.from_state} -> "
                    f"{change.to_state}"
                    f" ({change.reason})"
                )
