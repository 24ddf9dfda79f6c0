"""triggerer.queues: the task queues a triggerer serves (comma-separated; NULL: every queue),
so that doctor and tasks explain name the triggers no live triggerer serves

Revision ID: 0019
Revises: 0018
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0019"
down_revision = "0018"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("triggerer", sa.Column("queues", sa.String(256), nullable=True))


def downgrade() -> None:
    op.drop_column("triggerer", "queues")
