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
from sqlalchemy import exists, func, select, update
from sqlalchemy.exc import IntegrityError, SQLAlchemyError
from sqlalchemy.orm import Session, sessionmaker

from broker.client import Broker, RedisVersionError
from broker.lease import TAKEOVER_HEARTBEATS
from broker.streams import StreamKeys, task_label
from deferral import doctor as checklist
from deferral import migrate, pools, transitions
from deferral.baseoperator import BaseOperator
from deferral.config import Settings
from deferral.crypto import Cipher, DecryptionError
from deferral.dag import DAG, DagDefinitionError
from deferral.dagbag import DagBag, DagNotFound
from deferral.db import make_engine, make_sessionmaker
from deferral.models import (
    DagRun,
    Outbox,
    Pool,
    TaskInstance,
    TaskReschedule,
    TaskStateChange,
    Trigger,
    Triggerer,
)
from deferral.process import settings_or_exit
from deferral.states import FAIL_METHOD, FINISHED_STATES, DagRunState, TaskState
from deferral.trigger_rules import TriggerRule, evaluate


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


@tasks.command("explain")
@click.argument("dag_id")
@click.argument("run_id")
@click.argument("task_id")
def tasks_explain(dag_id: str, run_id: str, task_id: str) -> None:
    """Say why TASK_ID of a run is in its state, and what it waits for.

    After its state and try: for none, each upstream task's state and the trigger rule; for
    scheduled, its pool's free slots and the DAG's max_active_tasks; for queued, since when; for
    deferred, its trigger, the triggerer running it and the timeout; for up_for_retry, when the
    retry is due; for finished states, the last recorded reason.
    """
    settings = settings_or_exit()
    dag, dag_error = _find_dag(settings, dag_id)
    lines: list[str] = []
    with _sessions(settings)() as session:
        run = session.scalars(
            select(DagRun).where(DagRun.dag_id == dag_id, DagRun.run_id == run_id)
        ).one_or_none()
        if run is None:
            known = dag is not None or session.scalar(
                select(exists().where(DagRun.dag_id == dag_id))
            )
            _fail(f"DAG {dag_id!r} has no run {run_id!r}" if known else dag_error)
            return
        tis = session.scalars(
            select(TaskInstance)
            .where(
                TaskInstance.dag_id == dag_id,
                TaskInstance.run_id == run_id,
                TaskInstance.task_id == task_id,
            )
            .order_by(TaskInstance.map_index)
        ).all()
        if not tis:
            if dag is None or task_id not in dag.task_dict:
                owner = (
                    f"DAG {dag_id!r}" if dag is not None else f"run {run_id!r} of DAG {dag_id!r}"
                )
                _fail(f"{owner} has no task {task_id!r}")
                return
            lines = [
                f"{task_label(dag_id, run_id, task_id, -1)}: no task instance yet",
                f"  DAG run is {run.state}: the scheduler creates the run's task instances when"
                " it starts the run (is `scheduler consume` running?)",
            ]
        for ti in tis:
            lines += _explain(session, settings, dag, run, ti)
    for line in lines:
        click.echo(line)


def _find_dag(settings: Settings, dag_id: str) -> tuple[DAG | None, str]:
    """The DAG from the DAGs folder, or None and why not."""
    try:
        return DagBag(settings.dags_folder).collect().get_dag(dag_id), ""
    except DagNotFound as exc:
        return None, str(exc)


# What each trigger rule waits for, in words.
_RULE_WAITS_FOR: dict[TriggerRule, str] = {
    TriggerRule.ALL_SUCCESS: "every upstream task to succeed",
    TriggerRule.ALL_FAILED: "every upstream task to fail",
    TriggerRule.ALL_DONE: "every upstream task to finish, however it ends",
    TriggerRule.ONE_FAILED: "one upstream task to fail",
    TriggerRule.ONE_SUCCESS: "one upstream task to succeed",
    TriggerRule.NONE_FAILED: "every upstream task to finish without failing (skipped is fine)",
    TriggerRule.NONE_FAILED_MIN_ONE_SUCCESS: (
        "every upstream task to finish without failing, and one to succeed"
    ),
    TriggerRule.NONE_SKIPPED: "every upstream task to finish without being skipped",
    TriggerRule.ALWAYS: "nothing: it runs at once",
}


def _explain(
    session: Session, settings: Settings, dag: DAG | None, run: DagRun, ti: TaskInstance
) -> list[str]:
    now: dt.datetime = session.scalars(select(func.now())).one()
    label = task_label(ti.dag_id, ti.run_id, ti.task_id, ti.map_index)
    lines = [f"{label}: {ti.state} (try {ti.try_number} of at most {ti.max_tries + 1})"]
    task = dag.task_dict.get(ti.task_id) if dag is not None else None
    if dag is None:
        lines.append(
            f"  DAG {ti.dag_id!r} is not in the DAGs folder {settings.dags_folder}:"
            " no scheduler can advance this run"
        )
    elif task is None:
        lines.append(f"  task {ti.task_id!r} is no longer in DAG {dag.dag_id!r} ({dag.fileloc})")
    if run.state != DagRunState.RUNNING and ti.state not in FINISHED_STATES:
        lines.append(f"  DAG run is {run.state}")
    state = TaskState(ti.state)
    if state is TaskState.NONE:
        lines += _explain_waiting(session, ti, task)
    elif state is TaskState.SCHEDULED:
        lines += _explain_scheduled(session, dag, ti)
    elif state is TaskState.QUEUED:
        stream = StreamKeys(settings.stream_prefix).queue(ti.queue)
        lines.append(
            f"  queued since {_when(ti.queued_at)} ({_relative(now, ti.queued_at)}):"
            f" waits for a worker reading {stream} (`worker consume --queue {ti.queue}`)"
        )
    elif state is TaskState.RUNNING:
        resumed = f", resumed at {ti.next_method}" if ti.next_method else ""
        lines.append(
            f"  running since {_when(ti.start_date)} on {ti.hostname or '-'}"
            f" (worker {ti.worker or '-'}){resumed}"
        )
    elif state is TaskState.DEFERRED:
        lines += _explain_deferred(session, settings, ti, now)
    elif state is TaskState.UP_FOR_RESCHEDULE:
        due = session.scalars(
            select(TaskReschedule.reschedule_date)
            .where(TaskReschedule.task_instance_id == ti.id)
            .order_by(TaskReschedule.id.desc())
            .limit(1)
        ).first()
        lines.append(f"  next poke due at {_when(due)} ({_relative(now, due)})")
    elif state is TaskState.UP_FOR_RETRY:
        if task is None or ti.end_date is None:
            lines.append("  retry due: unknown (no end date, or the task is not in the DAG file)")
        else:
            due = ti.end_date + task.retry_delay
            lines.append(
                f"  failed at {_when(ti.end_date)}, retry_delay {task.retry_delay}:"
                f" retry due at {_when(due)} ({_relative(now, due)})"
            )
    if state is TaskState.UP_FOR_RETRY or state in FINISHED_STATES:
        lines += _last_change(session, ti)
    return lines


def _explain_waiting(session: Session, ti: TaskInstance, task: BaseOperator | None) -> list[str]:
    """State none: what the trigger rule waits for, and the upstream states it sees."""
    if task is None:
        return []
    rule = TriggerRule(task.trigger_rule)
    upstream = sorted(task.upstream_task_ids)
    if not upstream:
        return ["  no upstream tasks: the scheduler schedules it once the run is running"]
    states: dict[str, str] = {
        task_id: state
        for task_id, state in session.execute(
            select(TaskInstance.task_id, TaskInstance.state).where(
                TaskInstance.dag_id == ti.dag_id,
                TaskInstance.run_id == ti.run_id,
                TaskInstance.task_id.in_(upstream),
            )
        ).all()
    }
    lines = [f"  trigger rule {rule}: waits for {_RULE_WAITS_FOR[rule]}"]
    for task_id in upstream:
        missing = "" if task_id in states else " (no task instance yet)"
        lines.append(f"  upstream {task_id}: {states.get(task_id, TaskState.NONE)}{missing}")
    decision = evaluate(rule, [states.get(t, TaskState.NONE) for t in upstream])
    if decision is None:
        pending = [t for t in upstream if states.get(t, TaskState.NONE) not in FINISHED_STATES]
        lines.append(f"  not decided yet: waits for {', '.join(pending)} to finish")
    elif decision is TaskState.SCHEDULED:
        lines.append("  the rule is met: the scheduler schedules it on its next pass")
    else:
        lines.append(f"  the rule says {decision}: the scheduler sets it on its next pass")
    return lines


def _explain_scheduled(session: Session, dag: DAG | None, ti: TaskInstance) -> list[str]:
    """State scheduled: the pool slots and run slots it needs before it is dispatched."""
    lines: list[str] = []
    if ti.next_method == FAIL_METHOD:
        lines.append("  its deferral timed out or its trigger failed: it fails when it next runs")
    elif ti.next_method:
        lines.append(f"  its trigger fired: it resumes at {ti.next_method}")
    waits_for: list[str] = []
    pool = session.get(Pool, ti.pool)
    if pool is None:
        lines.append(f"  pool {ti.pool!r} does not exist")
        waits_for.append(f"pool {ti.pool!r} to be created")
    else:
        # free_slots locks the pool row; this session is rolled back when the command ends.
        free = pools.free_slots(session, [ti.pool]).get(ti.pool, 0)
        lines.append(
            f"  pool {ti.pool}: {free} of {pool.slots} slots free, it needs {ti.pool_slots}"
        )
        if free < ti.pool_slots:
            waits_for.append("pool slots")
    if dag is not None:
        active = session.scalar(
            select(func.count())
            .select_from(TaskInstance)
            .where(
                TaskInstance.dag_id == ti.dag_id,
                TaskInstance.run_id == ti.run_id,
                TaskInstance.state.in_([TaskState.QUEUED, TaskState.RUNNING]),
            )
        )
        lines.append(
            f"  DAG max_active_tasks {dag.max_active_tasks}:"
            f" {active} task(s) of this run queued or running"
        )
        if (active or 0) >= dag.max_active_tasks:
            waits_for.append("a task of this run to finish (max_active_tasks)")
    if waits_for:
        lines.append(f"  waits for {' and '.join(waits_for)}")
    else:
        lines.append("  nothing holds it back: the scheduler dispatches it on its next pass")
    return lines


def _explain_deferred(
    session: Session, settings: Settings, ti: TaskInstance, now: dt.datetime
) -> list[str]:
    """State deferred: its trigger, the triggerer running it, the resume method and timeout."""
    trigger = session.get(Trigger, ti.trigger_id) if ti.trigger_id is not None else None
    if trigger is None:
        lines = [
            f"  waits on trigger {ti.trigger_id}, whose row is missing: nothing will resume it"
            " but its timeout (clear or mark the task)"
        ]
    else:
        lines = [f"  waits on trigger {trigger.id} ({trigger.classpath})"]
        triggerer = session.get(Triggerer, trigger.triggerer_id) if trigger.triggerer_id else None
        if trigger.triggerer_id is None:
            lines.append("  no triggerer has picked the trigger up yet")
        elif triggerer is None:
            lines.append(f"  run by triggerer {trigger.triggerer_id}, which is not registered")
        else:
            age = max(0.0, (now - triggerer.latest_heartbeat).total_seconds())
            alive = (
                triggerer.state == "running" and age <= TAKEOVER_HEARTBEATS * settings.heartbeat_sec
            )
            lines.append(
                f"  run by triggerer {triggerer.name} on {triggerer.hostname} ({triggerer.state}),"
                f" heartbeat {age:.1f}s ago: {'alive' if alive else 'stale'}"
            )
    lines.append(f"  resumes at next_method {ti.next_method}")
    if ti.trigger_timeout is None:
        lines.append("  trigger_timeout: none (waits until the trigger fires)")
    else:
        left = (ti.trigger_timeout - now).total_seconds()
        if left >= 0:
            lines.append(f"  trigger_timeout {_when(ti.trigger_timeout)}: {left:.0f}s left")
        elif -left <= checklist.EXPIRED_GRACE_SEC:
            lines.append(
                f"  trigger_timeout {_when(ti.trigger_timeout)}: passed {-left:.0f}s ago;"
                " the scheduler fails it within a second"
            )
        else:
            lines.append(
                f"  trigger_timeout {_when(ti.trigger_timeout)}: passed {-left:.0f}s ago;"
                " a running scheduler would have failed it (is `scheduler consume` running?)"
            )
    return lines


def _last_change(session: Session, ti: TaskInstance) -> list[str]:
    change = session.scalars(
        select(TaskStateChange)
        .where(TaskStateChange.task_instance_id == ti.id)
        .order_by(TaskStateChange.id.desc())
        .limit(1)
    ).first()
    if change is None:
        return ["  no state change recorded"]
    reason = (change.reason or "no reason recorded").replace("\n", "\n    ")
    return [
        f"  last change: {change.from_state} -> {change.to_state} at {_when(change.at)}: {reason}"
    ]


def _relative(now: dt.datetime, moment: dt.datetime | None) -> str:
    if moment is None:
        return "unknown"
    seconds = (moment - now).total_seconds()
    return f"in {seconds:.0f}s" if seconds >= 0 else f"{-seconds:.0f}s ago"


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


# -- doctor ----------------------------------------------------------------------------------------


@main.command("doctor")
def doctor_command() -> None:
    """Check why deferred tasks may be stuck; exit 1 if any check fails.

    Prints one line per check, `ok|warn|fail  <check>: <detail>`:

    \b
    triggerer alive     deferred tasks, but no triggerer heartbeating (fail)
    capacity            alive triggerers' capacity below the deferred tasks (warn)
    expired timeouts    deferrals over 10 s past their timeout: no scheduler (fail)
    orphaned triggers   triggers no task waits on (warn); deferred tasks
                        whose trigger row is missing (fail)
    unpublished outbox  outbox rows unpublished for over 30 s: no relay (fail)
    dead letters        entries in the dead-letter stream (warn)
    redis data          the epoch key is missing: Redis lost its data (warn)
    """
    settings = settings_or_exit()
    checks: list[checklist.Check] = []
    try:
        with _sessions(settings)() as session:
            checks += _database_checks(session, settings)
    except SQLAlchemyError as exc:
        checks.append(_fail_check("database", f"cannot query Postgres: {_first_line(exc)}"))
    try:
        broker = Broker.from_url(settings.redis_url, settings.stream_prefix)
    except (RedisError, RedisVersionError) as exc:
        checks.append(_fail_check("redis", f"cannot reach Redis: {_first_line(exc)}"))
    else:
        try:
            checks += _redis_checks(broker)
        except RedisError as exc:
            checks.append(_fail_check("redis", f"cannot query Redis: {_first_line(exc)}"))
        finally:
            broker.close()
    for check in checks:
        click.echo(check.line())
    sys.exit(checklist.exit_code(checks))


def _fail_check(name: str, detail: str) -> checklist.Check:
    return checklist.Check(checklist.Status.FAIL, name, detail)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _database_checks(session: Session, settings: Settings) -> list[checklist.Check]:
    """Gather the numbers the Postgres checks decide on; ages use the database's clock."""
    ti = TaskInstance
    deferred_state = ti.state == TaskState.DEFERRED
    now: dt.datetime = session.scalars(select(func.now())).one()
    stale_after = TAKEOVER_HEARTBEATS * settings.heartbeat_sec
    deferred = session.scalar(select(func.count()).select_from(ti).where(deferred_state)) or 0

    alive: list[Triggerer] = []
    stale: list[tuple[str, float]] = []
    for triggerer in session.scalars(select(Triggerer).order_by(Triggerer.name)):
        age = max(0.0, (now - triggerer.latest_heartbeat).total_seconds())
        if triggerer.state == "running" and age <= stale_after:
            alive.append(triggerer)
        else:
            name = triggerer.name
            stale.append(
                (name if triggerer.state == "running" else f"{name} ({triggerer.state})", age)
            )

    grace = dt.timedelta(seconds=checklist.EXPIRED_GRACE_SEC)
    expired, oldest_timeout = session.execute(
        select(func.count(), func.min(ti.trigger_timeout)).where(
            deferred_state, ti.trigger_timeout < func.now() - grace
        )
    ).one()

    orphans = session.scalars(
        select(Trigger.id).where(~exists().where(ti.trigger_id == Trigger.id)).order_by(Trigger.id)
    ).all()
    stranded = session.execute(
        select(ti.dag_id, ti.run_id, ti.task_id, ti.map_index)
        .outerjoin(Trigger, Trigger.id == ti.trigger_id)
        .where(deferred_state, Trigger.id.is_(None))
        .order_by(ti.id)
    ).all()

    stale_outbox = dt.timedelta(seconds=checklist.OUTBOX_STALE_SEC)
    unpublished, oldest_row = session.execute(
        select(func.count(), func.min(Outbox.created_at)).where(
            Outbox.published_at.is_(None), Outbox.created_at < func.now() - stale_outbox
        )
    ).one()

    return [
        checklist.triggerer_alive(deferred, [t.name for t in alive], stale, stale_after),
        checklist.capacity(deferred, sum(t.capacity for t in alive), len(alive)),
        checklist.expired_timeouts(expired, _age_seconds(now, oldest_timeout)),
        checklist.orphaned_triggers(list(orphans), [task_label(*row) for row in stranded]),
        checklist.unpublished_outbox(unpublished, _age_seconds(now, oldest_row)),
    ]


def _age_seconds(now: dt.datetime, moment: dt.datetime | None) -> float | None:
    return None if moment is None else max(0.0, (now - moment).total_seconds())


def _redis_checks(broker: Broker) -> list[checklist.Check]:
    dead = broker.keys.dead
    length = int(broker.redis.xlen(dead))
    newest_error = None
    newest = broker.newest(dead) if length else None
    if newest is not None:
        raw = newest.fields.get(b"error")
        newest_error = None if raw is None else raw.decode(errors="replace")
    epoch = bool(broker.redis.exists(broker.keys.epoch))
    return [
        checklist.dead_letters(dead, length, newest_error),
        checklist.redis_data(broker.keys.epoch, epoch),
    ]


# -- key rotation ----------------------------------------------------------------------------------


@main.command("rotate-fernet-key")
@click.option(
    "--batch-size",
    type=click.IntRange(min=1),
    default=500,
    show_default=True,
    help="Rows re-encrypted per transaction.",
)
def rotate_fernet_key(batch_size: int) -> None:
    """Re-encrypt stored kwargs with the first key of DEFERRAL_FERNET_KEY.

    Every trigger.kwargs and task_instance.next_kwargs is decrypted with whichever configured
    key sealed it and encrypted again with the first key, in batches of --batch-size rows.

    \b
    To replace a key:
      1. Add the new key first and keep the old one after it,
         DEFERRAL_FERNET_KEY=NEW,OLD, on every service and here; restart them.
      2. Run this command: what OLD sealed is sealed with NEW now.
      3. Remove the old key, DEFERRAL_FERNET_KEY=NEW, and restart the services.

    A value that no configured key decrypts is reported, one line per table and id, and left as
    it is; the others are rotated all the same, and the command exits 1.

    Stream entries and outbox rows are not rewritten: a trigger deferred before step 1 keeps a
    token sealed with OLD in its deferral:triggers entry, and a triggerer that loads it again
    (after a restart or a takeover) needs OLD to read it. Remove OLD once such triggers have
    fired.
    """
    settings = settings_or_exit()
    cipher = Cipher(settings.fernet_keys)
    sessions = _sessions(settings)
    unreadable = 0
    columns: list[tuple[type[Trigger] | type[TaskInstance], str]] = [
        (Trigger, "kwargs"),
        (TaskInstance, "next_kwargs"),
    ]
    for model, column in columns:
        table = model.__tablename__
        rotated, bad = _rotate_column(sessions, cipher, model, column, batch_size)
        left = f", {len(bad)} left as they were (unreadable)" if bad else ""
        click.echo(f"{table}.{column}: {rotated} row(s) rotated{left}")
        for row_id in bad:
            click.echo(
                f"error: {table} id {row_id}: {column} decrypts with no configured key", err=True
            )
        unreadable += len(bad)
    if unreadable:
        sys.exit(1)


def _rotate_column(
    sessions: sessionmaker[Session],
    cipher: Cipher,
    model: type[Trigger] | type[TaskInstance],
    column: str,
    batch_size: int,
) -> tuple[int, list[int]]:
    """Re-encrypt ``model.column`` batch by batch (one transaction each, rows locked); return how
    many rows were rotated and the ids of those no configured key decrypts."""
    attribute = getattr(model, column)
    rotated, last_id = 0, 0
    unreadable: list[int] = []
    while True:
        with sessions.begin() as session:
            rows = session.execute(
                select(model.id, attribute)
                .where(model.id > last_id, attribute.is_not(None))
                .order_by(model.id)
                .limit(batch_size)
                .with_for_update()
            ).all()
            if not rows:
                return rotated, unreadable
            last_id = rows[-1][0]
            changes: list[dict[str, Any]] = []
            for row_id, token in rows:
                try:
                    changes.append({"id": row_id, column: cipher.rotate(token)})
                except DecryptionError:  # no key decrypts it, or not a token at all
                    unreadable.append(row_id)
            if changes:
                session.execute(update(model), changes)
            rotated += len(changes)


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
