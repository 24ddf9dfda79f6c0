"""``deferral dead``: list, explain, re-drive and drop dead letters (``deferral:dead``).

The decisions (what a sealed entry is, whether its work is still wanted, the fenced re-drive) are
in :mod:`broker.deadletters`; the commands only format them.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import click

from broker import deadletters
from broker.client import Broker, RedisSetupError
from broker.streams import one_line
from deferral.runtime import secrets_masker
from deferral.runtime.config import Settings
from deferral.runtime.crypto import Cipher
from deferral.runtime.process import command_group, settings_or_exit
from deferral_cli.common import (
    EXIT_FAILED,
    cell,
    emit,
    fail,
    output_options,
    sessions,
)
from readmodel.deadletters import dead_letter_record

DEFAULT_LIMIT = 50
MAX_LIMIT = 100_000


@command_group()
def dead() -> None:
    """Dead letters: entries a consumer set aside (bad data, or delivered too often).

    Each keeps in clear where it came from, one line of why, its delivery count, its task and
    the consumer that set it aside; the original entry is sealed with the Fernet key.
    """


@contextmanager
def _broker(settings: Settings) -> Iterator[Broker]:
    try:
        broker = Broker.from_url(
            settings.redis_url, settings.stream_prefix, shards=settings.stream_shards
        )
    except RedisSetupError as exc:
        fail(f"Redis: {exc}")
        raise  # unreachable: fail exits
    try:
        yield broker
    finally:
        broker.close()


_REASON_SHOWN = 80


def _short(text: Any) -> str:
    value = str(text)
    return value if len(value) <= _REASON_SHOWN else value[: _REASON_SHOWN - 1] + "\u2026"


def _ids(ctx: click.Context, param: click.Parameter, values: Sequence[str]) -> list[str]:
    """Every ID well formed, or a usage error naming the first that is not (before any change)."""
    for value in values:
        if not deadletters.valid_dead_id(value):
            shown = one_line(value, 40)
            raise click.BadParameter(
                f"{shown!r} is not a dead letter id (like 1700000000000-0)", ctx, param
            )
    return list(dict.fromkeys(values))  # each once, in the order given


def _one_id(ctx: click.Context, param: click.Parameter, value: str) -> str:
    return _ids(ctx, param, [value])[0]


@dead.command("list")
@click.option(
    "--stream", help="Only those from this stream: a key, or triggers, events, queue:NAME."
)
@click.option(
    "--limit",
    type=click.IntRange(1, MAX_LIMIT),
    default=DEFAULT_LIMIT,
    show_default=True,
    help="At most this many, newest first.",
)
@output_options
def list_command(stream: str | None, limit: int, output: str) -> None:
    """Dead letters, newest first: id, when, source stream, task, deliveries, reason (one
    escaped line, cut in the table; whole in JSON) and whether it is verified (written by a
    deferral process: a letter anyone with Redis access added shows false, and none of its
    fields is proven)."""
    settings = settings_or_exit()
    cipher = Cipher(settings.fernet_keys)
    with _broker(settings) as broker:
        letters = deadletters.newest_dead_letters(broker, cipher, limit=limit, stream=stream)
    emit(
        output,
        [dead_letter_record(letter) for letter in letters],
        empty="no dead letters",
        cells={"reason": _short},
    )


@dead.command("show")
@click.argument("dead_id", metavar="ID", callback=_one_id)
@click.option(
    "--reveal",
    is_flag=True,
    help="Open the sealed original entry with the Fernet key (secrets in it stay masked).",
)
def show(dead_id: str, reveal: bool) -> None:
    """One dead letter: why, how often it was delivered and to whom, its task, where it came
    from and whether it is verified (written by a deferral process). The original entry stays
    sealed unless --reveal; an unverified letter's is never opened."""
    settings = settings_or_exit()
    cipher = Cipher(settings.fernet_keys)
    for key in settings.fernet_keys:
        secrets_masker.mask_secret(key)
    with _broker(settings) as broker:
        entry = broker.entry(broker.keys.dead, dead_id)
        if entry is None:
            fail(f"no dead letter {dead_id}")
            return
        letter = deadletters.read_dead_letter(cipher, entry)
        record: dict[str, Any] = {
            **dead_letter_record(letter),
            "source_id": letter.source_id or None,
            "consumer": letter.consumer or None,
        }
        if not letter.verified:
            record["payload"] = "unverified: not proven to be written by deferral, not opened"
        elif not letter.sealed:
            record["payload"] = "not kept (the entry was too large)"
        elif not reveal:
            record["payload"] = "sealed (--reveal opens it with the Fernet key)"
        else:
            try:
                sealed = deadletters.open_sealed(broker, cipher, entry)
            except deadletters.Unopenable as exc:
                record["payload"] = f"cannot be opened: {exc}"
            else:
                record["payload"] = deadletters.revealed(cipher, sealed)
    for name, value in record.items():
        if isinstance(value, dict):
            value = json.dumps(value, indent=2, sort_keys=True, default=str)
        click.echo(f"{name + ':':<12}{cell(value)}")


@dead.command("retry")
@click.argument("dead_ids", metavar="ID...", nargs=-1, required=True, callback=_ids)
def retry(dead_ids: list[str]) -> None:
    """Re-drive dead letters to the stream they came from, each at most once.

    Only a verified dead letter's sealed entry is trusted (a forged or unverified dead letter,
    or one whose key is gone, changes nothing), only what PostgreSQL confirms (a trigger's
    classpath, task and try), and only work still wanted is re-driven: a trigger whose task
    still defers on it, an event not yet applied, an attempt still queued at that try; and none
    while an entry for the same work is in flight. Prints a line per ID; exit 1 if any was not
    retried.
    """
    settings = settings_or_exit()
    cipher = Cipher(settings.fernet_keys)
    factory = sessions(settings)
    failed = False
    with _broker(settings) as broker:
        for dead_id in dead_ids:
            done = deadletters.retry(broker, factory, cipher, dead_id)
            if done.outcome == deadletters.Outcome.RETRIED:
                click.echo(f"retried {dead_id}: now {done.detail}")
            else:
                failed = True
                click.echo(f"error: {dead_id} not retried: {done.detail}", err=True)
    if failed:
        raise SystemExit(EXIT_FAILED)


@dead.command("drop")
@click.argument("dead_ids", metavar="ID...", nargs=-1, required=True, callback=_ids)
def drop(dead_ids: list[str]) -> None:
    """Delete dead letters. Prints a line per ID; exit 1 if any did not exist."""
    settings = settings_or_exit()
    with _broker(settings) as broker:
        dropped = deadletters.drop(broker, dead_ids)
    for dead_id, existed in dropped.items():
        if existed:
            click.echo(f"dropped {dead_id}")
        else:
            click.echo(f"error: no dead letter {dead_id}", err=True)
    if not all(dropped.values()):
        raise SystemExit(EXIT_FAILED)
