"""``deferral rotate-fernet-key``: re-encrypt stored kwargs with the first key."""

from __future__ import annotations

import sys
from typing import Any

import click
from sqlalchemy import ColumnElement, select, true, update
from sqlalchemy.orm import Session, sessionmaker

from deferral.runtime.crypto import Cipher, DecryptionError, Purpose
from deferral.runtime.process import settings_or_exit
from deferral.store.tables import (
    AssetWatcherRow,
    Signal,
    SignalWait,
    StoredConnection,
    StoredVariable,
    TaskInstance,
    Trigger,
    TriggerProgress,
)
from deferral_cli.common import sessions

# Tables with Fernet-sealed columns (each has an integer id to batch by).
Sealed = (
    Trigger
    | TaskInstance
    | StoredVariable
    | StoredConnection
    | Signal
    | AssetWatcherRow
    | SignalWait
    | TriggerProgress
)


@click.command("rotate-fernet-key")
@click.option(
    "--batch-size",
    type=click.IntRange(min=1),
    default=500,
    show_default=True,
    help="Rows re-encrypted per transaction.",
)
def rotate_fernet_key(batch_size: int) -> None:
    """Re-encrypt stored kwargs and secrets with the first key of DEFERRAL_FERNET_KEY.

    Every trigger.kwargs, task_instance.next_kwargs and next_event, variable.val (when
    encrypted), connection.password and connection.extra, signal.payload,
    asset_watcher.kwargs, signal_wait.fired (an all-of's fired branches) and
    trigger_progress.payload is decrypted with
    whichever configured key sealed it and encrypted again with the first key (the key derived
    from it for what the column holds; a value sealed before keys were derived per purpose is
    sealed under its purpose's key too), in batches of
    --batch-size rows.

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
    factory = sessions(settings)
    unreadable = 0
    columns: list[tuple[type[Sealed], str, Purpose, ColumnElement[bool] | None]] = [
        (Trigger, "kwargs", Purpose.TRIGGER_KWARGS, None),
        (TaskInstance, "next_kwargs", Purpose.RESUME_KWARGS, None),
        (TaskInstance, "next_event", Purpose.EVENT, None),
        (StoredVariable, "val", Purpose.STORED_SECRET, StoredVariable.is_encrypted.is_(True)),
        (StoredConnection, "password", Purpose.STORED_SECRET, None),
        (StoredConnection, "extra", Purpose.STORED_SECRET, None),
        (Signal, "payload", Purpose.SIGNAL_PAYLOAD, None),
        (AssetWatcherRow, "kwargs", Purpose.WATCHER_SPEC, None),
        (SignalWait, "fired", Purpose.EVENT, None),
        (TriggerProgress, "payload", Purpose.EVENT, None),
    ]
    for model, column, purpose, only in columns:
        table = model.__tablename__
        rotated, bad = _rotate_column(factory, cipher, model, column, purpose, batch_size, only)
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
    model: type[Sealed],
    column: str,
    purpose: Purpose,
    batch_size: int,
    only: ColumnElement[bool] | None = None,
) -> tuple[int, list[int]]:
    """Re-encrypt ``model.column`` (of the rows ``only`` selects) batch by batch (one
    transaction each, rows locked); return how many rows were rotated and the ids of those no
    configured key decrypts."""
    attribute = getattr(model, column)
    rotated, last_id = 0, 0
    unreadable: list[int] = []
    while True:
        with sessions.begin() as session:
            rows = session.execute(
                select(model.id, attribute)
                .where(model.id > last_id, attribute.is_not(None), true() if only is None else only)
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
                    changes.append({"id": row_id, column: cipher.rotate(purpose, token)})
                except DecryptionError:  # no key decrypts it, or not a token at all
                    unreadable.append(row_id)
            if changes:
                session.execute(update(model), changes)
            rotated += len(changes)
