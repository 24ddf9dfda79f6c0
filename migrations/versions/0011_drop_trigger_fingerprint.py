"""drop trigger.fingerprint: an unkeyed digest of a trigger's kwargs beside their ciphertext

Nothing read it, and anyone who could read the table could confirm a guess of the sealed
kwargs with it (issue 14).

Revision ID: 0011
Revises: 0010
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.drop_index("ix_trigger_fingerprint", table_name="trigger")
    op.drop_column("trigger", "fingerprint")


def downgrade() -> None:
    # The digests cannot be rebuilt (the kwargs are sealed): old rows get an empty one.
    op.add_column(
        "trigger",
        sa.Column("fingerprint", sa.String(length=64), nullable=False, server_default=""),
    )
    op.alter_column("trigger", "fingerprint", server_default=None)
    op.create_index("ix_trigger_fingerprint", "trigger", ["fingerprint"], unique=False)
