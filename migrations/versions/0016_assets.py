"""Assets: the assets parsed DAGs name, their events (from outlets and watchers, deduplicated
per asset by key), which DAGs are scheduled on them and which tasks update them, the events
queued for each consuming DAG and those each run consumed, and the watchers' leases

Revision ID: 0016
Revises: 0015
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0016"
down_revision = "0015"
branch_labels = None
depends_on = None

_TS = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "asset",
        sa.Column("name", sa.String(1000), primary_key=True),
        sa.Column("uri", sa.String(1000), nullable=False),
        sa.Column("group", sa.String(1000), nullable=False, server_default=sa.text("'asset'")),
        sa.Column("updated_at", _TS, nullable=False, server_default=sa.func.now()),
        sa.PrimaryKeyConstraint("name", name="pk_asset"),
    )
    op.create_table(
        "asset_event",
        sa.Column("id", sa.BigInteger, sa.Identity(), primary_key=True),
        sa.Column("asset_name", sa.String(1000), nullable=False),
        sa.Column(
            "extra",
            postgresql.JSONB(),
            nullable=False,
            server_default=sa.text("'{}'::jsonb"),
        ),
        sa.Column("source_dag_id", sa.String(250)),
        sa.Column("source_run_id", sa.String(250)),
        sa.Column("source_task_id", sa.String(250)),
        sa.Column("source_map_index", sa.Integer, nullable=False, server_default=sa.text("-1")),
        sa.Column("watcher", sa.String(1000)),
        sa.Column("dedup_key", sa.String(250)),
        sa.Column("timestamp", _TS, nullable=False, server_default=sa.func.now()),
        sa.PrimaryKeyConstraint("id", name="pk_asset_event"),
        sa.UniqueConstraint("asset_name", "dedup_key", name="uq_asset_event_asset_name_dedup_key"),
    )
    op.create_index("ix_asset_event_asset_name_id", "asset_event", ["asset_name", "id"])
    op.create_table(
        "dag_schedule_asset",
        sa.Column("dag_id", sa.String(250), nullable=False),
        sa.Column("asset_name", sa.String(1000), nullable=False),
        sa.PrimaryKeyConstraint("dag_id", "asset_name", name="pk_dag_schedule_asset"),
    )
    op.create_index("ix_dag_schedule_asset_asset_name", "dag_schedule_asset", ["asset_name"])
    op.create_table(
        "task_outlet_asset",
        sa.Column("dag_id", sa.String(250), nullable=False),
        sa.Column("task_id", sa.String(250), nullable=False),
        sa.Column("asset_name", sa.String(1000), nullable=False),
        sa.PrimaryKeyConstraint("dag_id", "task_id", "asset_name", name="pk_task_outlet_asset"),
    )
    op.create_table(
        "asset_dag_run_queue",
        sa.Column("target_dag_id", sa.String(250), nullable=False),
        sa.Column("asset_event_id", sa.BigInteger, nullable=False),
        sa.Column("asset_name", sa.String(1000), nullable=False),
        sa.PrimaryKeyConstraint("target_dag_id", "asset_event_id", name="pk_asset_dag_run_queue"),
    )
    op.create_table(
        "dag_run_asset_event",
        sa.Column("dag_run_id", sa.BigInteger, nullable=False),
        sa.Column("asset_event_id", sa.BigInteger, nullable=False),
        sa.ForeignKeyConstraint(
            ["dag_run_id"],
            ["dag_run.id"],
            name="fk_dag_run_asset_event_dag_run_id_dag_run",
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("dag_run_id", "asset_event_id", name="pk_dag_run_asset_event"),
    )
    op.create_table(
        "asset_watcher",
        sa.Column("id", sa.BigInteger, sa.Identity(), primary_key=True),
        sa.Column("dag_id", sa.String(250), nullable=False),
        sa.Column("asset_name", sa.String(1000), nullable=False),
        sa.Column("name", sa.String(1000), nullable=False),
        sa.Column("classpath", sa.String(1000), nullable=False),
        sa.Column("kwargs", sa.Text, nullable=False),
        sa.Column("triggerer_id", sa.String(250)),
        sa.Column("lease_expires_at", _TS),
        sa.PrimaryKeyConstraint("id", name="pk_asset_watcher"),
        sa.UniqueConstraint(
            "dag_id", "asset_name", "name", name="uq_asset_watcher_dag_id_asset_name_name"
        ),
    )


def downgrade() -> None:
    for table in (
        "asset_watcher",
        "dag_run_asset_event",
        "asset_dag_run_queue",
        "task_outlet_asset",
        "dag_schedule_asset",
        "asset_event",
        "asset",
    ):
        op.drop_table(table)
