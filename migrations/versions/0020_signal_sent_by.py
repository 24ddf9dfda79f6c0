"""signal.sent_by: the web user whose send stored a signal (NULL for the library and the CLI),
so that each user keeps a bounded number of signals (deferral/DECISIONS.md 80)

Revision ID: 0020_signal_sent_by
Revises: 0019
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0020_signal_sent_by"
down_revision = "0019"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("signal", sa.Column("sent_by", sa.String(64), nullable=True))
    op.create_index(
        "ix_signal_sent_by_id",
        "signal",
        ["sent_by", "id"],
        postgresql_where=sa.text("sent_by IS NOT NULL"),
    )


def downgrade() -> None:
    op.drop_index("ix_signal_sent_by_id", table_name="signal")
    op.drop_column("signal", "sent_by")
