"""``deferral signals``: send a signal to a key, list recent signals and waiting tasks."""

from __future__ import annotations

import json
from typing import Any

import click

from deferral import signals
from deferral.runtime.process import command_group, settings_or_exit
from deferral.store.metastore import metastore
from deferral_cli.common import emit, fail, output_options


@command_group("signals")
def signals_group() -> None:
    """Signals: resume the tasks waiting on a key (SignalTrigger / wait_for_signal)."""


@signals_group.command("send")
@click.argument("key")
@click.option("--payload", default=None, help="The payload, as JSON (default: null).")
@click.option(
    "--idempotency-key",
    default=None,
    help="Send once: a repeat with this key within DEFERRAL_IDEMPOTENCY_WINDOW_SEC sends nothing"
    " and shows the first send (the key reused for another KEY or payload is an error).",
)
def signals_send(key: str, payload: str | None, idempotency_key: str | None) -> None:
    """Send a signal to KEY: every task waiting on KEY resumes with the payload."""
    settings_or_exit()
    value: Any = None
    if payload is not None:
        try:
            value = json.loads(payload)
        except json.JSONDecodeError as exc:
            fail(f"--payload is not valid JSON: {exc}")
    try:
        sent = signals.send(key, value, idempotency_key=idempotency_key)
    except (signals.SignalError, signals.IdempotencyConflict) as exc:
        fail(str(exc))
        return
    if sent.replayed:
        click.echo(
            f"signal {sent.id} was sent to {sent.key} before with this idempotency key:"
            f" {len(sent.resumed)} task(s) resumed then, nothing sent now"
        )
        return
    click.echo(f"signal {sent.id} sent to {sent.key}: {len(sent.resumed)} task(s) resumed")


@signals_group.command("list")
@click.option("--key", default=None, help="Only this key.")
@click.option(
    "--limit",
    default=100,
    show_default=True,
    type=click.IntRange(1, 10_000),
    help="Show at most this many keys.",
)
@output_options
def signals_list(key: str | None, limit: int, output: str) -> None:
    """Keys with recent signals or waiting tasks, the most recently signalled first."""
    settings_or_exit()
    try:
        with metastore().sessions() as session:
            found = signals.activity(session, key, limit)
    except signals.SignalError as exc:
        fail(str(exc))
        return
    records = [
        {
            "key": a.key,
            "signals": a.signals,
            "last_signal_id": a.last_signal_id,
            "last_sent_at": a.last_sent_at,
            "waiting": len(a.waiting),
            "tasks": list(a.waiting),
        }
        for a in found
    ]
    emit(output, records, empty="no signals and no waiting tasks", cells={"tasks": _tasks})


def _tasks(tasks: list[str]) -> str:
    shown = ", ".join(tasks[:3])
    return shown + (f" and {len(tasks) - 3} more" if len(tasks) > 3 else "")
