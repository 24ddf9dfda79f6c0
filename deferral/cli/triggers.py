"""``deferral triggers`` and ``deferral triggerers``: triggers and the processes running them."""

from __future__ import annotations

import datetime as dt

import click
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from broker.streams import task_label
from deferral.cli.common import echo_table, sessions, when
from deferral.models import TaskInstance, Trigger, Triggerer
from deferral.process import settings_or_exit


@click.group()
def triggers() -> None:
    """Triggers (their kwargs stay encrypted and are never shown)."""


@triggers.command("list")
def triggers_list() -> None:
    """List triggers: class, the triggerer running it, and the task waiting on it."""
    settings = settings_or_exit()
    with sessions(settings)() as session:
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
            when(row.created_date),
            ", ".join(waiting.get(row.id, [])) or "-",
        )
        for row in found
    ]
    echo_table(("ID", "CLASSPATH", "TRIGGERER", "CREATED", "WAITING_TASK"), rows)


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


@click.group()
def triggerers() -> None:
    """Triggerer processes."""


@triggerers.command("list")
def triggerers_list() -> None:
    """List triggerers with their load and heartbeat.

    A triggerer is alive if its latest heartbeat is at most 2.1 x DEFERRAL_HEARTBEAT_SEC old,
    else stale.
    """
    settings = settings_or_exit()
    with sessions(settings)() as session:
        # The database's clock, the one that wrote the heartbeats: no skew with this host.
        now = session.scalars(select(func.now())).one()
        found = session.scalars(select(Triggerer).order_by(Triggerer.name)).all()
        rows = [_triggerer_row(t, now, 2.1 * settings.heartbeat_sec) for t in found]
    if not rows:
        click.echo("no triggerers")
        return
    header = ("NAME", "HOSTNAME", "PID", "STATE", "LOAD", "LATEST_HEARTBEAT", "AGE", "HEALTH")
    echo_table(header, rows)


def _triggerer_row(triggerer: Triggerer, now: dt.datetime, stale_after: float) -> tuple[str, ...]:
    age = max(0.0, (now - triggerer.latest_heartbeat).total_seconds())
    return (
        triggerer.name,
        triggerer.hostname,
        str(triggerer.pid),
        triggerer.state,
        f"{triggerer.load}/{triggerer.capacity}",
        when(triggerer.latest_heartbeat),
        f"{age:.1f}s",
        "alive" if age <= stale_after else "stale",
    )
