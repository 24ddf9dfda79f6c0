"""``deferral triggers``, ``triggerers`` and ``workers``: triggers and the processes running
them and the tasks."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from deferral.runtime.process import command_group, settings_or_exit
from deferral.store.tables import Triggerer, Worker
from deferral_cli.common import (
    Record,
    after_option,
    cursor_checked,
    emit,
    emit_page,
    limit_option,
    output_options,
    sessions,
)
from readmodel.processes import process_records, triggerer_own, worker_own
from readmodel.triggers import trigger_list


@command_group()
def triggers() -> None:
    """Triggers (their kwargs stay encrypted and are never shown)."""


@triggers.command("list")
@limit_option("triggers")
@after_option
@output_options
def triggers_list(limit: int, after: str | None, output: str) -> None:
    """List triggers, oldest first, a page at a time: class, the triggerer running it, and the
    task waiting on it."""
    settings = settings_or_exit()
    with sessions(settings)() as session, cursor_checked():
        page = trigger_list(session, limit=limit, after=after)
    emit_page(output, page, empty="no triggers")


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
