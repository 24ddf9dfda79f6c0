"""trigger.share_key: a keyed digest of a shared trigger's class and kwargs, unique, so that
tasks deferring on equal shared triggers wait on one trigger row (and one running trigger)

Revision ID: 0017
Revises: 0016
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0017"
down_revision = "0016"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("trigger", sa.Column("share_key", sa.String(length=64), nullable=True))
    op.create_index(op.f("ix_trigger_share_key"), "trigger", ["share_key"], unique=True)


def downgrade() -> None:
    op.drop_index(op.f("ix_trigger_share_key"), table_name="trigger")
    op.drop_column("trigger", "share_key")
