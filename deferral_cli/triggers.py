"""``deferral triggers``, ``triggerers`` and ``workers``: triggers and the processes running
them and the tasks."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from sqlalchemy import select
from sqlalchemy.orm import Session

from broker.streams import task_label
from deferral.runtime.process import command_group, settings_or_exit
from deferral.store.tables import TaskInstance, Trigger, Triggerer, Worker
from deferral_cli.common import Record, emit, output_options, sessions
from readmodel.processes import process_records, triggerer_own, worker_own


@command_group()
def triggers() -> None:
    """Triggers (their kwargs stay encrypted and are never shown)."""


@triggers.command("list")
@output_options
def triggers_list(output: str) -> None:
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
    records = [
        {
            "id": row.id,
            "classpath": row.classpath,
            "triggerer_id": row.triggerer_id,
            "created_date": row.created_date,
            "waiting_tasks": waiting.get(row.id, []),
        }
        for row in found
    ]
    emit(output, records, empty="no triggers")


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


@command_group()
def triggerers() -> None:
    """Triggerer processes."""


@triggerers.command("list")
@output_options
def triggerers_list(output: str) -> None:
    """List triggerers with their load, capacity and heartbeat.

    A triggerer is alive if its state is running and its latest heartbeat is at most
    2.1 x DEFERRAL_HEARTBEAT_SEC old (by the database's clock); stopped if it stopped cleanly
    (its row is pruned after DEFERRAL_PRUNE_OLDER_THAN); else stale.
    """
    _list_processes(output, Triggerer, triggerer_own, "no triggerers")


@command_group()
def workers() -> None:
    """Worker processes."""


@workers.command("list")
@output_options
def workers_list(output: str) -> None:
    """List workers with their queue, running attempts (load), concurrency and heartbeat.

    A worker is alive if its state is running and its latest heartbeat is at most
    2.1 x DEFERRAL_HEARTBEAT_SEC old (by the database's clock); stopped if it stopped cleanly
    (its row is pruned after DEFERRAL_PRUNE_OLDER_THAN); else stale.
    """
    _list_processes(output, Worker, worker_own, "no workers")


Process = TypeVar("Process", Triggerer, Worker)


def _list_processes(
    output: str, model: type[Process], own: Callable[[Process], Record], empty: str
) -> None:
    """Each process of a kind: who it is, what it has of its ``own``, and whether it is alive."""
    settings = settings_or_exit()
    with sessions(settings)() as session:
        records = process_records(session, model, own, settings.heartbeat_sec)
    emit(output, records, empty=empty)
