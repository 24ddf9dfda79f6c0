"""The Alembic migrations build exactly the schema the models declare."""

from __future__ import annotations

from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import create_engine, text

from deferral.store import migrate, partitions
from deferral.store.tables import Base


def test_migrated_schema_has_no_drift_from_models(database_url: str) -> None:
    engine = create_engine(database_url)
    with engine.connect() as conn:
        # The history tables' partitions are PostgreSQL's, not the models'.
        context = MigrationContext.configure(
            conn,
            opts={
                "compare_type": True,
                "include_name": lambda name, kind, _: (
                    not (kind == "table" and partitions.is_partition(name))
                ),
            },
        )
        diff = compare_metadata(context, Base.metadata)
    engine.dispose()
    assert diff == []


def test_every_model_table_exists_after_upgrade(database_url: str) -> None:
    engine = create_engine(database_url)
    with engine.connect() as conn:
        tables = set(
            conn.scalars(text("SELECT tablename FROM pg_tables WHERE schemaname = 'public'"))
        )
        default_pool = conn.scalar(text("SELECT slots FROM pool WHERE name = 'default_pool'"))
    engine.dispose()
    assert set(Base.metadata.tables) <= tables
    assert default_pool == 128


def test_upgrade_is_idempotent_and_check_reports_up_to_date(database_url: str) -> None:
    migrate.upgrade(database_url)
    engine = create_engine(database_url)
    assert migrate.pending_revisions(engine, database_url) == []
    engine.dispose()
