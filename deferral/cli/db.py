"""``deferral db``: the database schema."""

from __future__ import annotations

import click

from deferral import migrate
from deferral.cli.common import fail
from deferral.db import make_engine
from deferral.process import settings_or_exit


@click.group()
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
        fail(f"database lacks migration(s) {', '.join(pending)}: run `deferral db upgrade`")
    click.echo("database is up to date")
