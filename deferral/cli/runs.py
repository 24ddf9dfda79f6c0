"""``deferral runs``: a run, its task instances and their history."""

from __future__ import annotations

import click
from sqlalchemy import select

from deferral.cli.common import fail, find_run, sessions
from deferral.config import Settings
from deferral.models import TaskInstance, TaskStateChange
from deferral.process import settings_or_exit


@click.group()
def runs() -> None:
    """DAG runs."""


@runs.command("show")
@click.argument("dag_id")
@click.argument("run_id")
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
        for ti in tis:
            waiting = f" waiting on trigger {ti.trigger_id}" if ti.trigger_id else ""
            click.echo(f"  {ti.task_id}: {ti.state} (try {ti.try_number}){waiting}")
            if not history:
                continue
            changes = session.scalars(
                select(TaskStateChange)
                .where(TaskStateChange.task_instance_id == ti.id)
                .order_by(TaskStateChange.id)
            )
            for change in changes:
                click.echo(
                    f"    {change.at:%H:%M:%S.%f} {change.from_state} -> {change.to_state}"
                    f" ({change.reason})"
                )
