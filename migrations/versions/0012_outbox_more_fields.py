"""outbox.more_fields: the further entries of a row, so that a batch writes a row per stream

A transaction that stages many entries for one stream (a worker's batch of deferrals, a
scheduler's dispatch) wrote and then marked a row per entry; they now share one row.

Revision ID: 0012
Revises: 0011
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("outbox", sa.Column("more_fields", postgresql.JSONB(), nullable=True))


def downgrade() -> None:
    # Unpublished rows of several entries become a row per entry, so none is lost.
    op.execute(
        """
        INSERT INTO outbox (stream, fields, created_at)
        SELECT o.stream, more.fields, o.created_at
        FROM outbox AS o, jsonb_array_elements(o.more_fields) WITH ORDINALITY AS more (fields, n)
        WHERE o.published_at IS NULL AND o.more_fields IS NOT NULL
        ORDER BY o.id, more.n
        """
    )
    op.drop_column("outbox", "more_fields")
