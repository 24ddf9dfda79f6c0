"""dispatch index: scheduled task instances in dispatch order (priority first, then age)

Dispatch reads the first scheduled tasks by priority_weight DESC, id that the pools have room
for; without an index in that order it sorted every scheduled task on every loop (EXPLAIN
ANALYZE with 10,000 scheduled: a seq scan and a sort).

Revision ID: 0008
Revises: 0007
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_index(
        "ix_task_instance_scheduled",
        "task_instance",
        [sa.text("priority_weight DESC"), "id"],
        postgresql_where=sa.text("state = 'scheduled'"),
    )


def downgrade() -> None:
    op.drop_index("ix_task_instance_scheduled", table_name="task_instance")
