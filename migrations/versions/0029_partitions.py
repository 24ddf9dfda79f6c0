"""Partition-aligned asset runs: an asset event's partition key, and the key of a run a
DAG scheduled on asset partitions got

Revision ID: 0029_partitions
Revises: 0028_waits2
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0029_partitions"
down_revision = "0028_waits2"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("asset_event", sa.Column("partition_key", sa.String(250), nullable=True))
    op.add_column("dag_run", sa.Column("partition_key", sa.String(250), nullable=True))


def downgrade() -> None:
    op.drop_column("dag_run", "partition_key")
    op.drop_column("asset_event", "partition_key")
