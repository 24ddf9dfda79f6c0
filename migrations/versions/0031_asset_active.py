"""Assets unique by URI as well as by name: an asset whose URI another asset (of another name)
took first is inactive, and a task naming it in its inlets or outlets fails before it runs

Revision ID: 0031_asset_active
Revises: 0030_signal_count
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0031_asset_active"
down_revision = "0030_signal_count"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column(
        "asset", sa.Column("active", sa.Boolean(), nullable=False, server_default=sa.true())
    )
    op.create_index("ix_asset_uri", "asset", ["uri"])


def downgrade() -> None:
    op.drop_index("ix_asset_uri", table_name="asset")
    op.drop_column("asset", "active")
