"""``deferral tasks render``: what a task's template fields rendered to."""

from __future__ import annotations

import copy
import datetime as dt
import json
from typing import Any

import click
from sqlalchemy import select
from sqlalchemy.orm import Session

from broker.streams import task_label
from deferral.authoring.mappedoperator import MappedOperator
from deferral.authoring.templating import (
    TemplateRenderError,
    render_template_fields,
    rendered_fields,
)
from deferral.baseoperator import BaseOperator
from deferral.context import DagRunInfo, RuntimeTaskInstance, make_context
from deferral.exceptions import DagDefinitionError, MappingError
from deferral.runtime.config import Settings
from deferral.runtime.process import settings_or_exit
from deferral.store.tables import DagRun, RenderedTaskInstanceFields, TaskInstance
from deferral.store.xcom import DatabaseXComs
from deferral_cli.common import fail, find_run, load_dag, run_id_argument, sessions, when


@click.command("render")
@click.argument("dag_id")
@run_id_argument
@click.argument("task_id")
@click.option("--try", "try_number", type=click.IntRange(min=1), default=None, help="This try.")
@click.option("--map-index", type=int, default=-1, show_default=True, help="A mapped task's index.")
def tasks_render(
    dag_id: str, run_id: str, task_id: str, try_number: int | None, map_index: int
) -> None:
    """Show what TASK_ID's template fields rendered to in a run (secrets masked): as recorded
    by its latest try (or --try N); a task that has not run yet is rendered now, with the
    Variables, Connections and XComs of this moment."""
    settings = settings_or_exit()
    factory = sessions(settings)
    with factory() as session:
        run = find_run(session, dag_id, run_id)
        if run is None:
            fail(f"DAG {dag_id!r} has no run {run_id!r}")
            return
        ti = session.scalars(
            select(TaskInstance).where(
                TaskInstance.dag_id == dag_id,
                TaskInstance.run_id == run_id,
                TaskInstance.task_id == task_id,
                TaskInstance.map_index == map_index,
            )
        ).one_or_none()
        label = task_label(dag_id, run_id, task_id, map_index)
        recorded = _recorded(session, ti, try_number, label)
    if recorded is not None:
        row_try, rendered_at, fields = recorded
        click.echo(f"# {label} try {row_try}, rendered {when(rendered_at)}")
    else:
        fields = _render_now(settings, run, ti, task_id, map_index)
        click.echo(f"# {label}: no try recorded yet; rendered now")
    if not fields:
        click.echo("# (the task has no template fields)")
    for name, value in fields.items():
        click.echo("# ----------------------------------------------------------")
        click.echo(f"# property: {name}")
        click.echo("# ----------------------------------------------------------")
        click.echo(value if isinstance(value, str) else json.dumps(value, indent=2))


def _recorded(
    session: Session, ti: TaskInstance | None, try_number: int | None, label: str
) -> tuple[int, dt.datetime, dict[str, Any]] | None:
    """The recorded row of ``try_number`` (else of the latest try); None when there is none
    and no try was asked for."""
    rows = (
        []
        if ti is None
        else session.scalars(
            select(RenderedTaskInstanceFields)
            .where(RenderedTaskInstanceFields.task_instance_id == ti.id)
            .order_by(RenderedTaskInstanceFields.try_number.desc())
        ).all()
    )
    if try_number is None:
        return (rows[0].try_number, rows[0].rendered_at, rows[0].rendered) if rows else None
    for row in rows:
        if row.try_number == try_number:
            return row.try_number, row.rendered_at, row.rendered
    tries = ", ".join(str(row.try_number) for row in reversed(rows)) or "none"
    fail(f"{label}: nothing recorded for try {try_number} (tries recorded: {tries})")
    return None


def _render_now(
    settings: Settings, run: DagRun, ti: TaskInstance | None, task_id: str, map_index: int
) -> dict[str, Any]:
    """The fields rendered now, in a copy of the task from the DAGs folder (for a mapped task,
    the operator of map index ``map_index`` with its values as they are now); exits on
    error."""
    # Rendering runs the DAG file's code: the file is imported here, as `tasks test` does.
    dag = load_dag(settings, run.dag_id)
    try:
        task: BaseOperator = copy.deepcopy(dag.get_task(task_id))
    except DagDefinitionError as exc:
        fail(str(exc))
        return {}
    runtime_ti = RuntimeTaskInstance(
        id=ti.id if ti is not None else 0,
        dag_id=run.dag_id,
        run_id=run.run_id,
        task_id=task_id,
        map_index=map_index,
        try_number=max(ti.try_number, 1) if ti is not None else 1,
        xcoms=DatabaseXComs(sessions(settings)),
        first_started_at=dt.datetime.now(dt.UTC),
    )
    dag_run = DagRunInfo.of(run)
    if task.is_mapped and map_index < 0:
        fail(f"task {task_id!r} is mapped: show one map index with --map-index N")
        return {}
    context = make_context(task, dag_run, runtime_ti)
    try:
        if isinstance(task, MappedOperator):
            task = task.unmap(context)
            context["task"] = task
        render_template_fields(task, context)
    except (TemplateRenderError, MappingError) as exc:
        fail(str(exc))
        return {}
    return rendered_fields(task)
