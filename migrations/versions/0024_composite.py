"""Waits that compose (issue 33): a signal wait row per branch of an any-of / all-of, its
payload filter, the cancel-on rows, and one timer row per composite wait

Revision ID: 0024_composite
Revises: 0023_readmodel_list_order
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0024_composite"
down_revision = "0023_readmodel_list_order"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # '' for a plain signal wait, the branch's name in a composite, '~cancel' for a cancel-on.
    op.add_column("signal_wait", sa.Column("branch", sa.Text(), nullable=False, server_default=""))
    # The payload filter as a jsonpath predicate (in clear, as the key is).
    op.add_column("signal_wait", sa.Column("match", sa.Text(), nullable=True))
    # Of a cancel-on row: the state its task ends in ('skipped' or 'failed').
    op.add_column("signal_wait", sa.Column("cancels", sa.Text(), nullable=True))
    # True when the rows are the whole wait (nothing is published to a triggerer).
    op.add_column(
        "signal_wait",
        sa.Column("holds", sa.Boolean(), nullable=False, server_default=sa.text("true")),
    )
    # Of an all-of's branch that fired: its payload, sealed as an event.
    op.add_column("signal_wait", sa.Column("fired", sa.Text(), nullable=True))
    # An id of its own (``deferral rotate-fernet-key`` re-seals ``fired`` by it); a deferral
    # has one row per branch.
    op.drop_constraint("pk_signal_wait", "signal_wait", type_="primary")
    op.add_column("signal_wait", sa.Column("id", sa.BigInteger(), sa.Identity(), nullable=False))
    op.create_primary_key("pk_signal_wait", "signal_wait", ["id"])
    op.create_unique_constraint(
        "uq_signal_wait_trigger_id_branch", "signal_wait", ["trigger_id", "branch"]
    )
    op.create_table(
        "wait_timer",
        sa.Column(
            "trigger_id",
            sa.BigInteger(),
            sa.ForeignKey(
                "trigger.id", name="fk_wait_timer_trigger_id_trigger", ondelete="CASCADE"
            ),
            primary_key=True,
        ),
        sa.Column("branch", sa.Text(), nullable=False),
        sa.Column("due_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("holds", sa.Boolean(), nullable=False, server_default=sa.text("true")),
    )
    op.create_index("ix_wait_timer_due_at", "wait_timer", ["due_at"])


def downgrade() -> None:
    op.drop_table("wait_timer")
    op.execute("DELETE FROM signal_wait WHERE branch <> ''")
    op.drop_constraint("uq_signal_wait_trigger_id_branch", "signal_wait", type_="unique")
    op.drop_constraint("pk_signal_wait", "signal_wait", type_="primary")
    op.create_primary_key("pk_signal_wait", "signal_wait", ["trigger_id"])
    for column in ("id", "fired", "holds", "cancels", "match", "branch"):
        op.drop_column("signal_wait", column)
