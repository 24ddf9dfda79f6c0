"""idempotency_key: requests made once under an idempotency key, with their first answer
(deferral/DECISIONS.md 89); api_token: machines' API tokens, as keyed hashes
(webserver/DECISIONS.md)

Revision ID: 0026_idem
Revises: 0025_dagstore
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0026_idem"
down_revision = "0025_dagstore"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "idempotency_key",
        sa.Column("scope", sa.Text(), nullable=False),
        sa.Column("key", sa.String(255), nullable=False),
        sa.Column("fingerprint", sa.Text(), nullable=False),
        sa.Column("answer", postgresql.JSONB(), nullable=True),
        sa.Column(
            "created_at", sa.DateTime(timezone=True), server_default=sa.func.now(), nullable=False
        ),
        sa.PrimaryKeyConstraint("scope", "key", name="pk_idempotency_key"),
    )
    op.create_index("ix_idempotency_key_created_at", "idempotency_key", ["created_at"])
    op.create_table(
        "api_token",
        sa.Column("id", sa.BigInteger(), sa.Identity(), nullable=False),
        sa.Column("name", sa.String(64), nullable=False),
        sa.Column("scopes", postgresql.ARRAY(sa.Text()), nullable=False),
        sa.Column("digest", sa.Text(), nullable=False),
        sa.Column(
            "created_at", sa.DateTime(timezone=True), server_default=sa.func.now(), nullable=False
        ),
        sa.PrimaryKeyConstraint("id", name="pk_api_token"),
        sa.UniqueConstraint("name", name="uq_api_token_name"),
    )


def downgrade() -> None:
    op.drop_table("api_token")
    op.drop_index("ix_idempotency_key_created_at", table_name="idempotency_key")
    op.drop_table("idempotency_key")
