"""``deferral db``: the database schema."""

from __future__ import annotations

import click

from deferral.runtime.config import parse_duration
from deferral.runtime.process import command_group, settings_or_exit
from deferral.store import migrate, retention
from deferral.store.db import make_engine, make_sessionmaker
from deferral_cli.common import fail


@command_group()
def db() -> None:
    """Database schema."""


@db.command()
def upgrade() -> None:
    """Create or migrate the schema to the latest revision; say which revisions were applied."""
    settings = settings_or_exit()
    engine = make_engine(settings.database_url)
    try:
        pending = migrate.pending_revisions(engine, settings.database_url)
        if not pending:
            at = ", ".join(migrate.current_revisions(engine))
            click.echo(f"already at {at}: nothing to apply")
            return
        migrate.upgrade(settings.database_url)
    finally:
        engine.dispose()
    click.echo(f"applied {', '.join(pending)}")


@db.command()
def check() -> None:
    """Exit 1 if the schema lacks migrations (run `deferral db upgrade`)."""
    settings = settings_or_exit()
    engine = make_engine(settings.database_url)
    try:
        pending = migrate.pending_revisions(engine, settings.database_url)
        at = ", ".join(migrate.current_revisions(engine)) or "no revision"
    finally:
        engine.dispose()
    if pending:
        fail(
            f"database (at {at}) lacks migration(s) {', '.join(pending)}: run `deferral db upgrade`"
        )
    click.echo(f"database is up to date (at {at})")


@db.command()
@click.option(
    "--older-than",
    "older_than",
    default="7d",
    show_default=True,
    help="Age of what goes: 7d, 12h, 30m, 45s (or seconds).",
)
@click.option(
    "--batch-size",
    type=click.IntRange(min=1),
    default=5000,
    show_default=True,
    help="Rows deleted per transaction (smaller: shorter locks).",
)
def prune(older_than: str, batch_size: int) -> None:
    """Delete history older than --older-than that no running run needs: published outbox rows,
    resume events (but those of queued or running runs), state changes and task logs of
    finished runs, then those runs with their task instances, XComs, rendered fields and
    reschedules (but each DAG's latest scheduled or backfill run, which its schedule follows),
    and the rows of schedulers, workers and triggerers that stopped heartbeating (never one
    that beat in the last 10 minutes). The history tables' partitions of the days before the
    cutoff (taken back to the start of its UTC day) are dropped whole, once what unfinished
    runs need of them has moved to the default partition. The scheduler does the same every
    hour (DEFERRAL_PRUNE_OLDER_THAN)."""
    try:
        age = parse_duration(older_than)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--older-than") from None
    settings = settings_or_exit()
    engine = make_engine(settings.database_url)
    try:
        pruned = retention.prune(make_sessionmaker(engine), age, batch_size)
    finally:
        engine.dispose()
    click.echo(f"{pruned.describe()} older than {older_than}")
