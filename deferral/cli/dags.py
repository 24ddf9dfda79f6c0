"""``deferral dags``: list the DAGs, trigger a run and wait for it."""

from __future__ import annotations

import datetime as dt
import json
import sys
import time
from typing import Any

import click
from sqlalchemy import select
from sqlalchemy.exc import IntegrityError

from deferral import transitions
from deferral.cli.common import dagbag, fail, sessions
from deferral.config import Settings
from deferral.dagbag import DagNotFound
from deferral.models import DagRun
from deferral.process import settings_or_exit
from deferral.states import DagRunState


@click.group()
def dags() -> None:
    """DAGs in the DAGs folder."""


@dags.command("list")
def dags_list() -> None:
    """List DAGs and the files that failed to load."""
    bag = dagbag(settings_or_exit())
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


def trigger(settings: Settings, dag_id: str, conf: dict[str, Any], run_id: str | None) -> str:
    try:
        dagbag(settings).get_dag(dag_id)
    except DagNotFound as exc:
        fail(str(exc))
    logical_date = dt.datetime.now(dt.UTC)
    run_id = run_id or f"manual__{logical_date.isoformat()}"
    try:
        with sessions(settings).begin() as session:
            transitions.create_dag_run(session, dag_id, run_id, logical_date, conf)
    except IntegrityError:
        fail(f"DAG {dag_id!r} already has a run {run_id!r}")
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
    run_id = trigger(settings, dag_id, conf, run_id)
    if wait:
        state = wait_for_run(settings, dag_id, run_id, timeout)
        click.echo(f"run {run_id}: {state}")
        sys.exit(0 if state == DagRunState.SUCCESS else 1)


def wait_for_run(settings: Settings, dag_id: str, run_id: str, timeout: float | None) -> str:
    factory = sessions(settings)
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        with factory() as session:
            state = session.scalar(
                select(DagRun.state).where(DagRun.dag_id == dag_id, DagRun.run_id == run_id)
            )
        if state in (DagRunState.SUCCESS, DagRunState.FAILED):
            return str(state)
        if deadline is not None and time.monotonic() > deadline:
            fail(f"run {run_id} still {state} after {timeout:g}s")
        time.sleep(0.5)
