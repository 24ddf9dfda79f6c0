"""``deferral triggers``, ``triggerers`` and ``workers``: triggers and the processes running
them and the tasks."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar, cast

from sqlalchemy import select
from sqlalchemy.orm import Session

from broker.streams import task_label
from deferral.runtime.process import command_group, settings_or_exit
from deferral.store.tables import TaskInstance, Trigger, Triggerer, Worker
from deferral_cli.common import (
    Record,
    emit,
    output_options,
    page_options,
    say_next_page,
    sessions,
)
from readmodel.records import process_records, triggerer_own, worker_own


@command_group()
def triggers() -> None:
    """Triggers (their kwargs stay encrypted and are never shown)."""


@triggers.command("list")
@page_options
@output_options
def triggers_list(limit: int, after: int | None, output: str) -> None:
    """List triggers, oldest first, a page at a time (``--limit``, ``--after``): class, the
    triggerer running it, and the tasks waiting on it."""
    settings = settings_or_exit()
    with sessions(settings)() as session:
        # Named columns only: the kwargs (ciphertext) never leave the database.
        found = session.execute(
            select(Trigger.id, Trigger.classpath, Trigger.triggerer_id, Trigger.created_date)
            .where(Trigger.id > (after or 0))
            .order_by(Trigger.id)
            .limit(limit + 1)
        ).all()
        shown = found[:limit]
        waiting = _waiting_tasks(session, [row.id for row in shown])
    records = [
        {
            "id": row.id,
            "classpath": row.classpath,
            "triggerer_id": row.triggerer_id,
            "created_date": row.created_date,
            "waiting_tasks": waiting.get(row.id, []),
        }
        for row in shown
    ]
    emit(output, records, empty="no triggers")
    say_next_page(shown[-1].id if shown else None, len(found) > limit)


def _waiting_tasks(session: Session, trigger_ids: list[int]) -> dict[int, list[str]]:
    """Trigger id -> labels (dag.run.task[map]) of the task instances waiting on it, for these
    triggers."""
    query = (
        select(
            TaskInstance.trigger_id,
            TaskInstance.dag_id,
            TaskInstance.run_id,
            TaskInstance.task_id,
            TaskInstance.map_index,
        )
        .where(TaskInstance.trigger_id.in_(trigger_ids))
        .order_by(TaskInstance.id)
    )
    waiting: dict[int, list[str]] = {}
    for trigger_id, dag_id, run_id, task_id, map_index in session.execute(query):
        label = task_label(dag_id, run_id, task_id, map_index)
        waiting.setdefault(cast(int, trigger_id), []).append(label)  # IN: never null
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
