"""scheduler heartbeat: a row per scheduler process, for ``deferral health``

Revision ID: 0005
Revises: 0004
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def _timestamp(name: str) -> sa.Column:
    return sa.Column(
        name, sa.DateTime(timezone=True), server_default=sa.text("now()"), nullable=False
    )


def upgrade() -> None:
    op.create_table(
        "scheduler",
        sa.Column("name", sa.String(length=250), nullable=False),
        sa.Column("hostname", sa.String(length=1000), nullable=False),
        sa.Column("pid", sa.Integer(), nullable=False),
        _timestamp("started_at"),
        _timestamp("latest_heartbeat"),
        sa.Column("state", sa.String(length=20), nullable=False),
        sa.PrimaryKeyConstraint("name", name=op.f("pk_scheduler")),
    )


def downgrade() -> None:
    op.drop_table("scheduler")
