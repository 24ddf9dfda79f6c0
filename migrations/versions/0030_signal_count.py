"""signal_count: how many signals each web user (or API token) has kept, in stripes, so that a
send finds its sender's excess over the quota without walking its kept signals
(deferral/DECISIONS.md 80)

Revision ID: 0030_signal_count
Revises: 0029_partitions
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0030_signal_count"
down_revision = "0029_partitions"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "signal_count",
        sa.Column("sent_by", sa.String(64), nullable=False),
        sa.Column("stripe", sa.SmallInteger(), nullable=False),
        sa.Column("stored", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("sent_by", "stripe", name="pk_signal_count"),
    )
    op.execute(
        "INSERT INTO signal_count (sent_by, stripe, stored)"
        " SELECT sent_by, 0, count(*) FROM signal WHERE sent_by IS NOT NULL GROUP BY sent_by"
    )


def downgrade() -> None:
    op.drop_table("signal_count")
