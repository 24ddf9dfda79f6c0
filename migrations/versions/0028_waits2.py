"""Waits, continued (issue 33): resumed tasks first in the dispatch index, the progress a trigger
reports before its event, and the heartbeat deadlines of callback waits

Revision ID: 0028_waits2
Revises: 0027_af3b
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0028_waits2"
down_revision = "0027_af3b"
branch_labels = None
depends_on = None

_SCHEDULED = sa.text("state = 'scheduled'")


def upgrade() -> None:
    # Dispatch order: priority weight, then resumed tasks (a next method to run), then age.
    op.drop_index("ix_task_instance_scheduled", table_name="task_instance")
    op.create_index(
        "ix_task_instance_scheduled",
        "task_instance",
        [sa.text("priority_weight DESC"), sa.text("(next_method IS NOT NULL) DESC"), "id"],
        postgresql_where=_SCHEDULED,
    )
    # What a trigger reported before its event: the last few of each try, numbered from 1 (so
    # the highest number, less the rows kept, is how many were dropped).
    op.create_table(
        "trigger_progress",
        # An id of its own: `deferral rotate-fernet-key` re-seals the payloads by it.
        sa.Column("id", sa.BigInteger(), sa.Identity(), primary_key=True),
        sa.Column(
            "task_instance_id",
            sa.BigInteger(),
            sa.ForeignKey(
                "task_instance.id",
                name="fk_trigger_progress_task_instance_id_task_instance",
                ondelete="CASCADE",
            ),
            nullable=False,
        ),
        sa.Column("try_number", sa.Integer(), nullable=False),
        sa.Column("seq", sa.Integer(), nullable=False),
        sa.Column(
            "recorded_at",
            sa.DateTime(timezone=True),
            nullable=False,
            server_default=sa.func.now(),
        ),
        sa.Column("payload", sa.Text(), nullable=False),  # Fernet token of its JSON
        sa.UniqueConstraint(
            "task_instance_id",
            "try_number",
            "seq",
            name="uq_trigger_progress_task_instance_id_try_number_seq",
        ),
    )
    # A callback wait's heartbeat deadline: pushed on by each heartbeat posted to its token.
    op.create_table(
        "callback_heartbeat",
        sa.Column(
            "trigger_id",
            sa.BigInteger(),
            sa.ForeignKey(
                "trigger.id", name="fk_callback_heartbeat_trigger_id_trigger", ondelete="CASCADE"
            ),
            primary_key=True,
        ),
        sa.Column("key", sa.Text(), primary_key=True),
        sa.Column("every_sec", sa.Float(), nullable=False),
        sa.Column("due_at", sa.DateTime(timezone=True), nullable=False),
    )
    op.create_index("ix_callback_heartbeat_due_at", "callback_heartbeat", ["due_at"])
    op.create_index("ix_callback_heartbeat_key", "callback_heartbeat", ["key"])


def downgrade() -> None:
    op.drop_table("callback_heartbeat")
    op.drop_table("trigger_progress")
    op.drop_index("ix_task_instance_scheduled", table_name="task_instance")
    op.create_index(
        "ix_task_instance_scheduled",
        "task_instance",
        [sa.text("priority_weight DESC"), "id"],
        postgresql_where=_SCHEDULED,
    )
