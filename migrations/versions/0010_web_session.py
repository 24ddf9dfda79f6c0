"""web_session: web UI logins kept server-side (logout ends every copy of a cookie)

Revision ID: 0010
Revises: 0009
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "web_session",
        sa.Column("id", sa.String(length=64), nullable=False),
        sa.Column("username", sa.String(length=64), nullable=False),
        sa.Column(
            "created_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("now()"),
            nullable=False,
        ),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_web_session")),
    )
    op.create_index(op.f("ix_web_session_username"), "web_session", ["username"])
    op.create_index(op.f("ix_web_session_expires_at"), "web_session", ["expires_at"])


def downgrade() -> None:
    op.drop_table("web_session")
