"""The ``deferral`` command: database, DAGs, runs, and a standalone mode for trying it out."""

from __future__ import annotations

import datetime as dt
import json
import signal
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import click
from redis.exceptions import RedisError
from sqlalchemy import func, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, sessionmaker

from broker.client import Broker, RedisVersionError
from broker.streams import task_label
from deferral import migrate, transitions
from deferral.baseoperator import BaseOperator
from deferral.config import Settings
from deferral.dag import DagDefinitionError
from deferral.dagbag import DagBag, DagNotFound
from deferral.db import make_engine, make_sessionmaker
from deferral.models import DagRun, TaskInstance, TaskStateChange, Trigger, Triggerer
from deferral.process import settings_or_exit
from deferral.states import DagRunState, TaskState


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


# -- tables ----------------------------------------------------------------------------------------


def _echo_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> None:
    """Print ``rows`` under ``header`` in left-aligned columns two spaces apart."""
    widths = [max(len(row[col]) for row in (header, *rows)) for col in range(len(header))]
    for row in (header, *rows):
        click.echo(
            "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        )


def _when(value: dt.datetime | None) -> str:
    return "-" if value is None else value.isoformat(timespec="seconds")


# -- tasks -----------------------------------------------------------------------------------------


@main.group()
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
def tasks_list(state: str | None, dag_id: str | None) -> None:
    """List task instances, newest first; deferred ones show their trigger and its timeout."""
    settings = settings_or_exit()
    query = select(TaskInstance).order_by(TaskInstance.id.desc())
    if state is not None:
        query = query.where(TaskInstance.state == state)
    if dag_id is not None:
        query = query.where(TaskInstance.dag_id == dag_id)
    with _sessions(settings)() as session:
        rows = [_task_row(ti) for ti in session.scalars(query)]
    if not rows:
        click.echo("no task instances")
        return
    header = ("DAG_ID", "RUN_ID", "TASK_ID", "STATE", "TRY", "TRIGGER", "TRIGGER_TIMEOUT")
    _echo_table(header, rows)


def _task_row(ti: TaskInstance) -> tuple[str, ...]:
    task_id = ti.task_id if ti.map_index < 0 else f"{ti.task_id}[{ti.map_index}]"
    deferred = ti.state == TaskState.DEFERRED
    trigger = str(ti.trigger_id) if deferred and ti.trigger_id is not None else "-"
    timeout = _when(ti.trigger_timeout) if deferred else "-"
    return (ti.dag_id, ti.run_id, task_id, ti.state, str(ti.try_number), trigger, timeout)


def _apply_by_user(
    dag_id: str, run_id: str, task_id: str, downstream: bool, change: Callable[..., bool]
) -> None:
    """Apply ``change(session, ti, task)`` to the task (and its downstream tasks) of one run."""
    settings = settings_or_exit()
    try:
        dag = _dagbag(settings).get_dag(dag_id)
        task_ids = [dag.get_task(task_id).task_id]
    except (DagNotFound, DagDefinitionError) as exc:
        _fail(str(exc))
        return
    if downstream:
        task_ids += sorted(dag.downstream_of(task_id))
    with _sessions(settings).begin() as session:
        run = session.scalars(
            select(DagRun).where(DagRun.dag_id == dag_id, DagRun.run_id == run_id)
        ).one_or_none()
        if run is None:
            _fail(f"DAG {dag_id!r} has no run {run_id!r}")
            return
        tis = session.scalars(
            select(TaskInstance)
            .where(
                TaskInstance.dag_id == dag_id,
                TaskInstance.run_id == run_id,
                TaskInstance.task_id.in_(task_ids),
            )
            .order_by(TaskInstance.id)
            .with_for_update()
        ).all()
        refused = []
        for ti in tis:
            if change(session, ti, dag.task_dict.get(ti.task_id)):
                click.echo(f"{ti.task_id}: {ti.state}")
            else:
                refused.append(f"{ti.task_id} ({ti.state})")
        transitions.reopen_dag_run(session, run)
    if refused:
        _fail(f"not changed while queued or running: {', '.join(refused)}")


@tasks.command("clear")
@click.argument("dag_id")
@click.argument("run_id")
@click.argument("task_id")
@click.option("--downstream", is_flag=True, help="Also clear every task downstream of it.")
def tasks_clear(dag_id: str, run_id: str, task_id: str, downstream: bool) -> None:
    """Run TASK_ID again (as a new try); a deferred one lets go of its trigger."""

    def clear(session: Session, ti: TaskInstance, task: BaseOperator | None) -> bool:
        return transitions.clear(session, ti, retries=task.retries if task else 0)

    _apply_by_user(dag_id, run_id, task_id, downstream, clear)


@tasks.command("mark")
@click.argument("dag_id")
@click.argument("run_id")
@click.argument("task_id")
@click.option(
    "--state",
    "to_state",
    type=click.Choice([s.value for s in (TaskState.SUCCESS, TaskState.FAILED, TaskState.SKIPPED)]),
    required=True,
    help="The state to set.",
)
@click.option("--downstream", is_flag=True, help="Also mark every task downstream of it.")
def tasks_mark(dag_id: str, run_id: str, task_id: str, to_state: str, downstream: bool) -> None:
    """Set TASK_ID's state; a deferred one lets go of its trigger."""

    def mark(session: Session, ti: TaskInstance, task: BaseOperator | None) -> bool:
        return transitions.mark(session, ti, TaskState(to_state))

    _apply_by_user(dag_id, run_id, task_id, downstream, mark)


# -- triggers --------------------------------------------------------------------------------------


@main.group()
def triggers() -> None:
    """Triggers (their kwargs stay encrypted and are never shown)."""


@triggers.command("list")
def triggers_list() -> None:
    """List triggers: class, the triggerer running it, and the task waiting on it."""
    settings = settings_or_exit()
    with _sessions(settings)() as session:
        # Named columns only: the kwargs (ciphertext) never leave the database.
        found = session.execute(
            select(
                Trigger.id, Trigger.classpath, Trigger.triggerer_id, Trigger.created_date
            ).order_by(Trigger.id)
        ).all()
        waiting = _waiting_tasks(session)
    if not found:
        click.echo("no triggers")
        return
    rows = [
        (
            str(row.id),
            row.classpath,
            row.triggerer_id or "-",
            _when(row.created_date),
            ", ".join(waiting.get(row.id, [])) or "-",
        )
        for row in found
    ]
    _echo_table(("ID", "CLASSPATH", "TRIGGERER", "CREATED", "WAITING_TASK"), rows)


def _waiting_tasks(session: Session) -> dict[int, list[str]]:
    """Trigger id -> labels (dag.run.task[map]) of the task instances waiting on it."""
    query = (
        select(
            Trigger.id,
            TaskInstance.dag_id,
            TaskInstance.run_id,
            TaskInstance.task_id,
            TaskInstance.map_index,
        )
        .join(TaskInstance, TaskInstance.trigger_id == Trigger.id)
        .order_by(TaskInstance.id)
    )
    waiting: dict[int, list[str]] = {}
    for trigger_id, dag_id, run_id, task_id, map_index in session.execute(query):
        waiting.setdefault(trigger_id, []).append(task_label(dag_id, run_id, task_id, map_index))
    return waiting


# -- triggerers ------------------------------------------------------------------------------------


@main.group()
def triggerers() -> None:
    """Triggerer processes."""


@triggerers.command("list")
def triggerers_list() -> None:
    """List triggerers with their load and heartbeat.

    A triggerer is alive if its latest heartbeat is at most 2.1 x DEFERRAL_HEARTBEAT_SEC old,
    else stale.
    """
    settings = settings_or_exit()
    with _sessions(settings)() as session:
        # The database's clock, the one that wrote the heartbeats: no skew with this host.
        now = session.scalars(select(func.now())).one()
        found = session.scalars(select(Triggerer).order_by(Triggerer.name)).all()
        rows = [_triggerer_row(t, now, 2.1 * settings.heartbeat_sec) for t in found]
    if not rows:
        click.echo("no triggerers")
        return
    header = ("NAME", "HOSTNAME", "PID", "STATE", "LOAD", "LATEST_HEARTBEAT", "AGE", "HEALTH")
    _echo_table(header, rows)


def _triggerer_row(triggerer: Triggerer, now: dt.datetime, stale_after: float) -> tuple[str, ...]:
    age = max(0.0, (now - triggerer.latest_heartbeat).total_seconds())
    return (
        triggerer.name,
        triggerer.hostname,
        str(triggerer.pid),
        triggerer.state,
        f"{triggerer.load}/{triggerer.capacity}",
        _when(triggerer.latest_heartbeat),
        f"{age:.1f}s",
        "alive" if age <= stale_after else "stale",
    )


# -- streams ---------------------------------------------------------------------------------------


@main.command()
def streams() -> None:
    """Show each stream's length, its consumer groups, their lag and pending entries per consumer.

    Covers the triggers, events and dead streams and every queue stream under the prefix.
    LAG is "-" where Redis does not report it (before Redis 7, or when it cannot tell).
    """
    settings = settings_or_exit()
    try:
        broker = Broker.from_url(settings.redis_url, settings.stream_prefix)
    except (RedisError, RedisVersionError) as exc:
        _fail(f"Redis: {exc}")
        return
    try:
        rows = [row for key in _stream_keys(broker) for row in _stream_rows(broker, key)]
    except RedisError as exc:
        _fail(f"Redis: {exc}")
        return
    finally:
        broker.close()
    _echo_table(("STREAM", "LENGTH", "GROUP", "PENDING", "LAG", "PENDING_PER_CONSUMER"), rows)


def _stream_keys(broker: Broker) -> list[str]:
    keys = broker.keys
    pattern = _glob_escape(keys.queue("")) + "*"
    queues = {key.decode() for key in broker.redis.scan_iter(match=pattern, _type="stream")}
    return [keys.triggers, keys.events, keys.dead, *sorted(queues)]


def _glob_escape(text: str) -> str:
    """``text`` as a literal in a Redis glob pattern (SCAN MATCH)."""
    return "".join(f"\\{ch}" if ch in "*?[]\\" else ch for ch in text)


def _stream_rows(broker: Broker, key: str) -> list[tuple[str, ...]]:
    if not broker.redis.exists(key):
        return [(key, "missing", "-", "-", "-", "-")]
    length = str(broker.redis.xlen(key))
    groups = broker.groups(key)
    if not groups:
        return [(key, length, "-", "-", "-", "-")]
    rows: list[tuple[str, ...]] = []
    for group in groups:
        name = str(group["name"])
        pending = broker.pending(key, name)
        per_consumer = " ".join(f"{c}={n}" for c, n in sorted(pending.per_consumer.items()))
        lag = group.get("lag")
        lag_text = "-" if lag is None else str(lag)
        rows.append((key, length, name, str(pending.count), lag_text, per_consumer or "-"))
    return rows


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
