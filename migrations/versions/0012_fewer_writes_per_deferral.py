"""outbox.more_fields, task_instance.next_event: fewer row writes and seals per deferral

outbox.more_fields: the further entries of a row. A transaction that stages many entries for
one stream (a worker's batch of deferrals, a scheduler's dispatch) wrote and then marked a row
per entry; they now share one row.

task_instance.next_event: the event a trigger resumed a task with, sealed as the triggerer sent
it, beside next_kwargs (the scheduler opened and sealed the kwargs again to merge it in).

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
    op.add_column("task_instance", sa.Column("next_event", sa.Text(), nullable=True))


def downgrade() -> None:
    # A task resumed but not yet started would lose its event: resume it at its failure method.
    op.execute(
        """
        UPDATE task_instance SET next_method = '__fail__', next_kwargs = NULL
        WHERE next_event IS NOT NULL AND state IN ('scheduled', 'queued')
        """
    )
    op.drop_column("task_instance", "next_event")
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
