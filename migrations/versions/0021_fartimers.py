"""trigger.far_moment: a far time trigger waits as a row, its entry published only once its
moment comes within the horizon (deferral.store.far_timers); a partial index on the moment of
the unpublished ones for the horizon pass.

Revision ID: 0021_fartimers
Revises: 0020_signal_sent_by
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0021_fartimers"
down_revision = "0020_signal_sent_by"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("trigger", sa.Column("far_moment", sa.DateTime(timezone=True), nullable=True))
    op.create_index(
        "ix_trigger_far_moment",
        "trigger",
        ["far_moment"],
        postgresql_where=sa.text("far_moment IS NOT NULL"),
    )


def downgrade() -> None:
    # Far timers not yet published are then deferred tasks whose trigger no stream holds: the
    # reconciler of the code before publishes them.
    op.drop_index("ix_trigger_far_moment", table_name="trigger")
    op.drop_column("trigger", "far_moment")
