"""Schema migrations (Alembic), run programmatically so they work from an installed package."""

from __future__ import annotations

from importlib import resources

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Engine


def alembic_config(database_url: str) -> Config:
    config = Config()
    config.set_main_option("script_location", str(resources.files("migrations")))
    config.set_main_option("sqlalchemy.url", database_url.replace("%", "%%"))
    return config


def upgrade(database_url: str, revision: str = "head") -> None:
    command.upgrade(alembic_config(database_url), revision)


def current_revisions(engine: Engine) -> list[str]:
    """The revisions the database is at (none for an empty database)."""
    with engine.connect() as conn:
        return sorted(MigrationContext.configure(conn).get_current_heads())


def pending_revisions(engine: Engine, database_url: str) -> list[str]:
    """Revisions not yet applied to the database, oldest first (empty when up to date)."""
    script = ScriptDirectory.from_config(alembic_config(database_url))
    current = set(current_revisions(engine))
    heads = tuple(script.get_heads())
    if current == set(heads):
        return []
    newest_first = [
        rev.revision
        for rev in script.iterate_revisions(heads, tuple(current) or "base")
        if rev.revision not in current
    ]
    return newest_first[::-1]  # in the order `db upgrade` applies them
