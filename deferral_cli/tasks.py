"""``deferral tasks``: list task instances, clear or mark them, explain their state (their
logs: ``logs.py``; their rendered fields: ``render.py``)."""

from __future__ import annotations

import click
from sqlalchemy import exists, select

from broker.streams import task_label
from deferral.runtime.process import command_group, settings_or_exit
from deferral.states import TaskState
from deferral.store import actions
from deferral.store.serialized_dags import read_dag
from deferral.store.tables import DagRun
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
    stored_dag,
    task_instances,
)
from deferral_cli.group import Lazy, LazyGroup
from readmodel.dags import not_found
from readmodel.explain import explain
from readmodel.tasks import task_list

# The subcommands defined in modules of their own, imported when invoked.
TASKS_ELSEWHERE = {
    "logs": Lazy(
        "deferral_cli.logs:tasks_logs",
        "Show the log of TASK_ID's latest try in a run (or of --try N), in order: what the task"
        " wrote (stdout, stderr, logging; secrets masked), the worker's lines about its attempts"
        " and the triggerer's about its deferrals.",
    ),
    "render": Lazy(
        "deferral_cli.render:tasks_render",
        "Show what TASK_ID's template fields rendered to in a run (secrets masked): as recorded"
        " by its latest try (or --try N); a task that has not run yet is rendered now, with the"
        " Variables, Connections and XComs of this moment.",
    ),
    "test": Lazy(
        "deferral_cli.dagtest:tasks_test",
        "Run TASK_ID once, in this process, ignoring its dependencies and recording no state,"
        " as Airflow's `tasks test`: in the run of DAG_ID at LOGICAL_DATE (or the run RUN_ID)"
        " if it exists (the task's XCom pulls read it; its pushes are written there, its state"
        " is left as it is), else in a run made for it and deleted afterwards.",
    ),
}


@command_group(cls=LazyGroup, lazy=TASKS_ELSEWHERE)
def tasks() -> None:
    """Task instances."""


@tasks.command("list")
@click.option(
    "--state",
    type=click.Choice([state.value for state in TaskState]),
    default=None,
    help="Only task instances in this state.",
)
@click.option("--dag-id", default=None, help="Only task instances of this DAG.")
@limit_option("task instances")
@after_option
@output_options
def tasks_list(
    state: str | None, dag_id: str | None, limit: int, after: str | None, output: str
) -> None:
    """List task instances, newest first, a page at a time; deferred ones show their trigger
    and its timeout."""
    settings = settings_or_exit()
    with sessions(settings)() as session, cursor_checked():
        page = task_list(session, limit=limit, after=after, state=state, dag_id=dag_id)
    emit_page(output, page, empty="no task instances")


_MAP_INDEX = click.option(
    "--map-index",
    "map_indexes",
    type=int,
    multiple=True,
    help="Only this map index of a mapped TASK_ID (repeat for several); default: all.",
)


def _apply_by_user(
    dag_id: str,
    run_id: str,
    task_id: str,
    downstream: bool,
    change: actions.Change,
    map_indexes: tuple[int, ...] = (),
) -> None:
    """Apply ``change`` to the task (its map indexes ``map_indexes``, else all) and its
    downstream tasks (all map indexes) of one run, saying what it did."""
    settings = settings_or_exit()
    try:
        done = actions.change_tasks(
            sessions(settings),
            stored_dag(settings, dag_id),
            run_id,
            task_id,
            change,
            downstream=downstream,
            map_indexes=map_indexes,
        )
    except actions.ActionError as exc:
        fail(str(exc))
        return
    for label, state in done.changed:
        click.echo(f"{label}: {state}")
    if done.refused:
        fail(f"not changed while queued or running: {', '.join(done.refused)}")


@tasks.command("clear")
@click.argument("dag_id")
@run_id_argument
@click.argument("task_id")
@click.option("--downstream", is_flag=True, help="Also clear every task downstream of it.")
@_MAP_INDEX
def tasks_clear(
    dag_id: str, run_id: str, task_id: str, downstream: bool, map_indexes: tuple[int, ...]
) -> None:
    """Run TASK_ID again (as a new try); a deferred one lets go of its trigger. A mapped task
    runs again over its input as it is then (map indexes added or removed as it says)."""
    _apply_by_user(dag_id, run_id, task_id, downstream, actions.clear_change, map_indexes)


@tasks.command("mark")
@click.argument("dag_id")
@run_id_argument
@click.argument("task_id")
@click.option(
    "--state",
    "to_state",
    type=click.Choice([s.value for s in actions.MARKABLE_STATES]),
    required=True,
    help="The state to set.",
)
@click.option("--downstream", is_flag=True, help="Also mark every task downstream of it.")
@_MAP_INDEX
def tasks_mark(
    dag_id: str,
    run_id: str,
    task_id: str,
    to_state: str,
    downstream: bool,
    map_indexes: tuple[int, ...],
) -> None:
    """Set TASK_ID's state; a deferred one lets go of its trigger."""
    _apply_by_user(dag_id, run_id, task_id, downstream, actions.mark_change(to_state), map_indexes)


@tasks.command("explain")
@click.argument("dag_id")
@run_id_argument
@click.argument("task_id")
@_MAP_INDEX
def tasks_explain(dag_id: str, run_id: str, task_id: str, map_indexes: tuple[int, ...]) -> None:
    """Say why TASK_ID of a run is in its state, and what it waits for.

    After its state and try: for none, each upstream task's state and the trigger rule; for
    scheduled, its pool's free slots and the DAG's max_active_tasks; for queued, since when; for
    deferred, its trigger, the triggerer running it and the timeout; for up_for_retry, when the
    retry is due; for finished states, the last recorded reason.
    """
    settings = settings_or_exit()
    lines: list[str] = []
    with sessions(settings)() as session:
        dag = read_dag(session, dag_id)
        dag_error = not_found(session, dag_id, settings.dags_folder)
        run = find_run(session, dag_id, run_id)
        if run is None:
            known = dag is not None or session.scalar(
                select(exists().where(DagRun.dag_id == dag_id))
            )
            fail(f"DAG {dag_id!r} has no run {run_id!r}" if known else dag_error)
            return
        tis = task_instances(session, dag_id, run_id, task_id)
        if map_indexes:
            tis = [ti for ti in tis if ti.map_index in map_indexes]
            if not tis:
                fail(f"task {task_id!r} of run {run_id!r} has no map index {map_indexes[0]}")
                return
        if not tis:
            if dag is None or task_id not in dag.task_dict:
                owner = (
                    f"DAG {dag_id!r}" if dag is not None else f"run {run_id!r} of DAG {dag_id!r}"
                )
                fail(f"{owner} has no task {task_id!r}")
                return
            lines = [
                f"{task_label(dag_id, run_id, task_id, -1)}: no task instance yet",
                f"  DAG run is {run.state}: the scheduler creates the run's task instances when"
                " it starts the run (is `scheduler consume` running?)",
            ]
        for ti in tis:
            lines += explain(session, settings, dag, run, ti)
    for line in lines:
        click.echo(line)
