"""``deferral dags``: list the DAGs, trigger a run and follow it."""

from __future__ import annotations

import datetime as dt
import shutil
import sys
from typing import Any

import click

from deferral.runtime import controls
from deferral.runtime.config import Settings
from deferral.runtime.process import command_group, settings_or_exit
from deferral.states import DagRunState
from deferral_cli.common import (
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_TIMED_OUT,
    DateTimeParam,
    emit,
    fail,
    load_dag,
    output_options,
    run_conf,
    sessions,
    stored_dag,
)
from deferral_cli.group import Lazy, LazyGroup, unescaped
from readmodel.dags import dag_list, import_errors, not_parsed_notice, wanted_tags

# The subcommands defined in modules of their own, imported when invoked.
DAGS_ELSEWHERE = {
    "backfill": Lazy(
        "deferral_cli.schedules:dags_backfill",
        "Create a backfill run of DAG_ID for every schedule interval whose logical date falls"
        " between START_DATE and END_DATE (both included).",
    ),
    "next-run": Lazy(
        "deferral_cli.schedules:dags_next_run",
        "Show the next run the scheduler will create for DAG_ID: its logical date, its data"
        " interval, and the moment after which it is created.",
    ),
    "pause": Lazy(
        "deferral_cli.schedules:dags_pause",
        "Pause DAG_ID: the scheduler creates no run and starts no queued run of it (backfill"
        " runs excepted) until it is unpaused.",
    ),
    "test": Lazy(
        "deferral_cli.dagtest:dags_test",
        "Run DAG_ID once, with no service running: the tasks whose upstreams are done run at"
        " once (up to --concurrency), deferrals included (their triggers run in this process),"
        " each task's state changes and log lines shown as they come.",
    ),
    "unpause": Lazy(
        "deferral_cli.schedules:dags_unpause",
        "Unpause DAG_ID: its schedule resumes (with catchup=False, from the latest interval).",
    ),
}


@command_group(cls=LazyGroup, lazy=DAGS_ELSEWHERE)
def dags() -> None:
    """DAGs in the DAGs folder."""


@dags.command("list")
@click.option(
    "--tags",
    "tags",
    multiple=True,
    help="Only DAGs with one of these tags (repeat, or separate with commas).",
)
@output_options
def dags_list(output: str, tags: tuple[str, ...]) -> None:
    """List the DAGs a scheduler parsed (schedule, paused, tasks, tags, file); the files that
    failed to load are named on stderr, and the command then exits 1. No DAG file is imported:
    before any scheduler has parsed the DAGs folder, it says so and exits 1."""
    settings = settings_or_exit()
    with sessions(settings)() as session:
        records = dag_list(session, wanted_tags(tags))
        errors = import_errors(session)
        unparsed = not_parsed_notice(session)
    if unparsed is not None:
        fail(unparsed)
    emit(output, records, empty="no DAGs", cells={"tags": lambda tags: ",".join(tags)})
    for error in errors:
        click.echo(f"error: {error['file']}: {error['error']}", err=True)
    if errors:
        sys.exit(EXIT_FAILED)


def trigger(
    settings: Settings,
    dag_id: str,
    conf: dict[str, Any],
    run_id: str | None,
    logical_date: dt.datetime | None = None,
    idempotency_key: str | None = None,
    partition_key: str | None = None,
) -> str:
    from deferral.runtime.crypto import Cipher
    from deferral.store import actions  # with the DAG machinery, which `dags list` may not need
    from deferral.store.idempotency import IdempotencyConflict

    stored = stored_dag(settings, dag_id)
    # A timetable of the DAG file's own is made again by its file alone (in a parse child,
    # within the import timeout): the one trigger that imports it.
    dag = stored if stored.timetable is not None else load_dag(settings, dag_id)
    keyed = (
        None
        if idempotency_key is None
        else actions.IdempotencyKey(idempotency_key, Cipher(settings.fernet_keys))
    )
    try:
        triggered = actions.trigger_run(
            sessions(settings),
            dag,
            conf,
            run_id,
            logical_date=logical_date,
            idempotency_key=keyed,
            partition_key=partition_key,
        )
    except (actions.ActionError, IdempotencyConflict) as exc:
        fail(str(exc))
        raise  # unreachable: fail exits
    if triggered.replayed:
        click.echo(
            f"{dag_id} {triggered.run_id} was triggered before with this idempotency key:"
            " no new run"
        )
        return triggered.run_id
    click.echo(f"triggered {dag_id} {triggered.run_id}")
    if triggered.paused:
        click.echo(f"DAG {dag_id} is paused: the run waits until `deferral dags unpause {dag_id}`")
    return triggered.run_id


@dags.command("trigger")
@click.argument("dag_id")
@click.option("--conf", "conf_json", default=None, help="Run configuration, a JSON object.")
@click.option("--run-id", default=None, help="Run id (default: manual__<logical date>).")
@click.option(
    "-e",
    "--logical-date",
    "--exec-date",
    "logical_date",
    type=DateTimeParam(),
    default=None,
    help="The run's logical date (default: now); naive ones are in DEFERRAL_DEFAULT_TIMEZONE.",
)
@click.option(
    "--idempotency-key",
    default=None,
    help="Trigger once: a repeat with this key within DEFERRAL_IDEMPOTENCY_WINDOW_SEC starts no"
    " run and shows the first one (the key reused with other arguments is an error).",
)
@click.option(
    "--partition-key",
    default=None,
    help="The run's partition key, which its outlet events carry (a DAG scheduled by"
    " CronPartitionTimetable, PartitionedAssetTimetable or PartitionedAtRuntime only).",
)
@click.option(
    "--wait",
    is_flag=True,
    help="Follow the run to its end, showing each task's state as it changes;"
    " exit 0 if it succeeded, 1 if it failed (naming its failed tasks), 3 if --timeout passed"
    " first, 130 on Ctrl-C (the run goes on).",
)
@click.option(
    "--timeout",
    type=click.FloatRange(min=0, min_open=True),
    default=None,
    help="With --wait: stop waiting after S seconds (the run goes on).",
)
def dags_trigger(
    dag_id: str,
    conf_json: str | None,
    run_id: str | None,
    logical_date: dt.datetime | None,
    idempotency_key: str | None,
    partition_key: str | None,
    wait: bool,
    timeout: float | None,
) -> None:
    """Start a run of DAG_ID."""

    conf = run_conf(conf_json)
    if timeout is not None and not wait:
        raise click.BadParameter("only means something with --wait", param_hint="--timeout")
    for value, what in ((dag_id, "DAG_ID"), (run_id, "--run-id")):
        try:
            controls.check_id(value or "", "id")
        except ValueError as exc:
            raise click.BadParameter(str(exc), param_hint=what) from None
    settings = settings_or_exit()
    run_id = trigger(settings, dag_id, conf, run_id, logical_date, idempotency_key, partition_key)
    if not wait:
        return
    try:
        follow_run(settings, dag_id, run_id, timeout)
    except KeyboardInterrupt:
        # Only the waiting stops: the run is the scheduler's, and 1 would say it failed.
        click.echo(
            f"\nstopped waiting; run {run_id} of DAG {dag_id} goes on"
            f" (`deferral runs show {dag_id} {run_id}`)",
            err=True,
        )
        sys.exit(EXIT_INTERRUPTED)


def follow_run(settings: Settings, dag_id: str, run_id: str, timeout: float | None) -> None:
    """Show the run's tasks until it ends; exit as it ended."""
    # Here, not at the top: the wait's state machine is no part of the other dags commands.
    from deferral_cli.wait import (
        Display,
        LiveBlock,
        PlainLines,
        failed_tasks,
        failure_lines,
        wait_for_run,
    )

    out = sys.stdout
    display: Display = (
        # The live block draws with control sequences and escapes what it shows itself.
        LiveBlock(unescaped(out), f"{dag_id} {run_id}", shutil.get_terminal_size().lines)
        if out.isatty()
        else PlainLines(out, lambda: dt.datetime.now(dt.UTC))
    )
    state = wait_for_run(sessions(settings), dag_id, run_id, timeout, display)
    if state is None:
        fail(
            f"run {run_id} of DAG {dag_id} not finished after {timeout:g}s; it goes on"
            f" (`deferral runs show {dag_id} {run_id}`)",
            EXIT_TIMED_OUT,
        )
    click.echo(f"run {run_id}: {state}")
    if state == DagRunState.SUCCESS:
        sys.exit(0)
    with sessions(settings)() as session:
        for line in failure_lines(*failed_tasks(session, dag_id, run_id)):
            click.echo(line)
    sys.exit(EXIT_FAILED)
