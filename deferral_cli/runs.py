"""``deferral runs``: a run, its task instances and their history."""

from __future__ import annotations

import click
from sqlalchemy import exists, select
from sqlalchemy.orm import Session

from deferral.runtime.config import Settings
from deferral.runtime.process import command_group, settings_or_exit
from deferral.states import DagRunState
from deferral.store.actions import ti_label
from deferral.store.tables import Dag, DagRun
from deferral_cli.common import (
    after_option,
    cursor_checked,
    emit_page,
    fail,
    find_run,
    limit_option,
    output_options,
    run_id_argument,
    sessions,
    stamp,
)
from readmodel.runs import run_list, run_task_instances
from readmodel.tasks import state_changes


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
@limit_option("runs", most=None)  # its --limit never had a bound: a contract
@after_option
@output_options
def runs_list(
    dag_id: str | None, state: str | None, limit: int, after: str | None, output: str
) -> None:
    """List DAG runs (of DAG_ID, if given), newest logical date first, a page at a time."""
    settings = settings_or_exit()
    with sessions(settings)() as session, cursor_checked():
        page = run_list(session, limit=limit, after=after, dag_id=dag_id, state=state)
        known = dag_id is None or page.rows or _dag_known(session, dag_id)
    if not known:
        fail(f"DAG {dag_id!r} not found")
    emit_page(output, page, empty="no runs")


def _dag_known(session: Session, dag_id: str) -> bool:
    if session.scalar(select(exists().where(DagRun.dag_id == dag_id))):
        return True
    # The dag row of each parsed DAG: no DAG file is imported to say whether it exists.
    return session.get(Dag, dag_id) is not None


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
        for ti in run_task_instances(session, dag_id, run_id):
            waiting = f" waiting on trigger {ti.trigger_id}" if ti.trigger_id else ""
            label = ti_label(ti.task_id, ti.map_index)
            click.echo(f"  {label}: {ti.state} (try {ti.try_number}){waiting}")
            if not history:
                continue
            for change in state_changes(session, ti.id):
                click.echo(
                    f"    {stamp(change.at, microseconds=True)} {change.from_state} -> "
                    f"{change.to_state}"
                    f" ({change.reason})"
                )
