"""Airflow 3's asset aliases (the assets each resolved to, the events added through each) and
state stores (a task instance's keys across its tries, an asset's keys across runs)

Revision ID: 0027_af3b
Revises: 0026_idem
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0027_af3b"
down_revision = "0026_idem"
branch_labels = None
depends_on = None

_TS = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "asset_alias_asset",
        sa.Column("alias_name", sa.String(1000), nullable=False),
        sa.Column("asset_name", sa.String(1000), nullable=False),
        sa.PrimaryKeyConstraint("alias_name", "asset_name", name="pk_asset_alias_asset"),
    )
    op.create_index("ix_asset_alias_asset_asset_name", "asset_alias_asset", ["asset_name"])
    op.create_table(
        "asset_alias_event",
        sa.Column("alias_name", sa.String(1000), nullable=False),
        sa.Column("asset_event_id", sa.BigInteger, nullable=False),
        sa.PrimaryKeyConstraint("alias_name", "asset_event_id", name="pk_asset_alias_event"),
    )
    op.create_table(
        "task_state",
        sa.Column("task_instance_id", sa.BigInteger, nullable=False),
        sa.Column("key", sa.String(512), nullable=False),
        sa.Column("value", postgresql.JSONB(), nullable=False),
        sa.Column("expires_at", _TS),
        sa.Column("updated_at", _TS, nullable=False, server_default=sa.func.now()),
        sa.ForeignKeyConstraint(
            ["task_instance_id"],
            ["task_instance.id"],
            name="fk_task_state_task_instance_id_task_instance",
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("task_instance_id", "key", name="pk_task_state"),
    )
    op.create_table(
        "asset_state",
        sa.Column("asset_name", sa.String(1000), nullable=False),
        sa.Column("key", sa.String(512), nullable=False),
        sa.Column("value", postgresql.JSONB(), nullable=False),
        sa.Column("updated_at", _TS, nullable=False, server_default=sa.func.now()),
        sa.PrimaryKeyConstraint("asset_name", "key", name="pk_asset_state"),
    )


def downgrade() -> None:
    for table in ("asset_state", "task_state", "asset_alias_event", "asset_alias_asset"):
        op.drop_table(table)
