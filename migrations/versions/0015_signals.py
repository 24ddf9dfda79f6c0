"""signal and signal_wait: signals sent to a key, kept for a bounded age, and the tasks
waiting on a key (a row, not a running trigger)

Revision ID: 0015
Revises: 0014
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0015"
down_revision = "0014"
branch_labels = None
depends_on = None


def _stamp(name: str) -> sa.Column[object]:
    """When the row was written (the clock at the write, not the transaction's start)."""
    return sa.Column(
        name,
        sa.DateTime(timezone=True),
        nullable=False,
        server_default=sa.text("clock_timestamp()"),
    )


def upgrade() -> None:
    op.create_table(
        "signal",
        sa.Column("id", sa.BigInteger(), sa.Identity(), primary_key=True),
        sa.Column("key", sa.Text(), nullable=False),
        # The payload, sealed (a Fernet token of its JSON), as a resumed task's event is.
        sa.Column("payload", sa.Text(), nullable=False),
        _stamp("sent_at"),
    )
    op.create_index("ix_signal_key_sent_at", "signal", ["key", "sent_at"])
    op.create_index("ix_signal_sent_at", "signal", ["sent_at"])
    op.create_table(
        "signal_wait",
        sa.Column(
            "trigger_id",
            sa.BigInteger(),
            sa.ForeignKey(
                "trigger.id", name="fk_signal_wait_trigger_id_trigger", ondelete="CASCADE"
            ),
            primary_key=True,
        ),
        sa.Column("key", sa.Text(), nullable=False),
        _stamp("created_at"),
    )
    op.create_index("ix_signal_wait_key", "signal_wait", ["key"])


def downgrade() -> None:
    op.drop_table("signal_wait")
    op.drop_table("signal")
