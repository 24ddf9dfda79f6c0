"""The ``deferral`` command: database, DAGs, runs, and a standalone mode for trying it out."""

from __future__ import annotations

import datetime as dt
import json
import signal
import sys
import time
from typing import Any

import click
from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, sessionmaker

from deferral import migrate, transitions
from deferral.config import Settings
from deferral.dagbag import DagBag, DagNotFound
from deferral.db import make_engine, make_sessionmaker
from deferral.models import DagRun, TaskInstance, TaskStateChange
from deferral.process import settings_or_exit
from deferral.states import DagRunState


def _fail(message: str, code: int = 1) -> None:
    click.echo(f"error: {message}", err=True)
    sys.exit(code)


@click.group()
def main() -> None:
    """deferral: a workflow runtime whose tasks can defer their waits to triggers."""


# -- db --------------------------------------------------------------------------------------------


@main.group()
def db() -> None:
    """Database schema."""


@db.command()
def upgrade() -> None:
    """Create or migrate the schema to the latest revision."""
    settings = settings_or_exit()
    migrate.upgrade(settings.database_url)
    click.echo("database is up to date")


@db.command()
def check() -> None:
    """Exit 1 if the schema lacks migrations (run `deferral db upgrade`)."""
    settings = settings_or_exit()
    pending = migrate.pending_revisions(make_engine(settings.database_url), settings.database_url)
    if pending:
        _fail(f"database lacks migration(s) {', '.join(pending)}: run `deferral db upgrade`")
    click.echo("database is up to date")


# -- dags ------------------------------------------------------------------------------------------


@main.group()
def dags() -> None:
    """DAGs in the DAGs folder."""


def _dagbag(settings: Settings) -> DagBag:
    try:
        return DagBag(settings.dags_folder).collect()
    except DagNotFound as exc:
        _fail(str(exc))
        raise  # unreachable: _fail exits


@dags.command("list")
def dags_list() -> None:
    """List DAGs and the files that failed to load."""
    bag = _dagbag(settings_or_exit())
    for dag_id, dag in sorted(bag.dags.items()):
        click.echo(f"{dag_id}\t{len(dag.tasks)} task(s)\t{dag.fileloc}")
    for path, error in sorted(bag.import_errors.items()):
        click.echo(f"error: {path}: {error}", err=True)
    if bag.import_errors:
        sys.exit(1)


def _parse_conf(raw: str | None) -> dict[str, Any]:
    if raw is None:
        return {}
    try:
        conf = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise click.BadParameter(f"not valid JSON ({exc.msg} at {exc.pos})") from None
    if not isinstance(conf, dict):
        raise click.BadParameter("must be a JSON object")
    return conf


def _trigger(settings: Settings, dag_id: str, conf: dict[str, Any], run_id: str | None) -> str:
    try:
        _dagbag(settings).get_dag(dag_id)
    except DagNotFound as exc:
        _fail(str(exc))
    logical_date = dt.datetime.now(dt.UTC)
    run_id = run_id or f"manual__{logical_date.isoformat()}"
    try:
        with _sessions(settings).begin() as session:
            transitions.create_dag_run(session, dag_id, run_id, logical_date, conf)
    except IntegrityError:
        _fail(f"DAG {dag_id!r} already has a run {run_id!r}")
    click.echo(f"triggered {dag_id} {run_id}")
    return run_id


@dags.command("trigger")
@click.argument("dag_id")
@click.option("--conf", "conf_json", default=None, help="Run configuration, a JSON object.")
@click.option("--run-id", default=None, help="Run id (default: manual__<logical date>).")
@click.option("--wait", is_flag=True, help="Wait for the run to finish; exit 1 if it failed.")
@click.option("--timeout", type=float, default=None, help="With --wait: give up after S seconds.")
def dags_trigger(
    dag_id: str, conf_json: str | None, run_id: str | None, wait: bool, timeout: float | None
) -> None:
    """Start a run of DAG_ID."""
    try:
        conf = _parse_conf(conf_json)
    except click.BadParameter as exc:
        exc.param_hint = "--conf"
        raise
    settings = settings_or_exit()
    run_id = _trigger(settings, dag_id, conf, run_id)
    if wait:
        state = _wait_for_run(settings, dag_id, run_id, timeout)
        click.echo(f"run {run_id}: {state}")
        sys.exit(0 if state == DagRunState.SUCCESS else 1)


def _sessions(settings: Settings) -> sessionmaker[Session]:
    return make_sessionmaker(make_engine(settings.database_url))


def _wait_for_run(settings: Settings, dag_id: str, run_id: str, timeout: float | None) -> str:
    sessions = _sessions(settings)
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        with sessions() as session:
            state = session.scalar(
                select(DagRun.state).where(DagRun.dag_id == dag_id, DagRun.run_id == run_id)
            )
        if state in (DagRunState.SUCCESS, DagRunState.FAILED):
            return str(state)
        if deadline is not None and time.monotonic() > deadline:
            _fail(f"run {run_id} still {state} after {timeout:g}s")
        time.sleep(0.5)


# -- runs ------------------------------------------------------------------------------------------


@main.group()
def runs() -> None:
    """DAG runs."""


@runs.command("show")
@click.argument("dag_id")
@click.argument("run_id")
@click.option("--history", is_flag=True, help="Also list every state change of every task.")
def runs_show(dag_id: str, run_id: str, history: bool) -> None:
    """Show a run, its task instances and (with --history) their state changes."""
    _show_run(settings_or_exit(), dag_id, run_id, history)


def _show_run(settings: Settings, dag_id: str, run_id: str, history: bool) -> None:
    with _sessions(settings)() as session:
        run = session.scalars(
            select(DagRun).where(DagRun.dag_id == dag_id, DagRun.run_id == run_id)
        ).one_or_none()
        if run is None:
            _fail(f"DAG {dag_id!r} has no run {run_id!r}")
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


# -- standalone ------------------------------------------------------------------------------------


@main.command()
@click.option("--dags-folder", default=None, help="DAGs folder (default: DEFERRAL_DAGS_FOLDER).")
@click.option(
    "--run",
    "run_dag",
    default=None,
    metavar="DAG_ID",
    help="Trigger DAG_ID, show how it went, and stop (exit 1 if it failed).",
)
@click.option(
    "--timeout", type=float, default=300, show_default=True, help="With --run: give up after S s."
)
def standalone(dags_folder: str | None, run_dag: str | None, timeout: float) -> None:
    """Run scheduler, triggerer and worker together, for trying deferral out.

    Unset settings default to local servers: Postgres on 127.0.0.1 (database deferral_demo,
    created if missing), Redis on 127.0.0.1, and a Fernet key kept in .deferral/fernet.key.
    """
    from deferral import standalone as embedded

    embedded.prepare_environment(dags_folder)
    settings = settings_or_exit()
    migrate.upgrade(settings.database_url)
    with embedded.running_services() as procs:
        if run_dag is None:
            click.echo("services running; Ctrl-C stops them")
            stop_signals = {signal.SIGINT, signal.SIGTERM}
            signal.pthread_sigmask(signal.SIG_BLOCK, stop_signals)
            signal.sigwait(stop_signals)
            return
        run_id = _trigger(settings, run_dag, {}, None)
        state = _wait_for_run(settings, run_dag, run_id, timeout)
        _show_run(settings, run_dag, run_id, history=True)
        if any(proc.poll() is not None for proc in procs):
            _fail("a service process exited early; see its log above")
    sys.exit(0 if state == DagRunState.SUCCESS else 1)
