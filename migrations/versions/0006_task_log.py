"""task logs: the lines of each try, and each try's size (bounded) and whether it was cut

Revision ID: 0006
Revises: 0005
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "task_log",
        sa.Column("id", sa.BigInteger(), sa.Identity(always=False), nullable=False),
        sa.Column("task_instance_id", sa.BigInteger(), nullable=False),
        sa.Column("try_number", sa.Integer(), nullable=False),
        sa.Column("at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("source", sa.String(length=20), nullable=False),
        sa.Column("text", sa.Text(), nullable=False),
        sa.ForeignKeyConstraint(
            ["task_instance_id"],
            ["task_instance.id"],
            name=op.f("fk_task_log_task_instance_id_task_instance"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_task_log")),
    )
    op.create_index(
        op.f("ix_task_log_task_instance_id_try_number_id"),
        "task_log",
        ["task_instance_id", "try_number", "id"],
        unique=False,
    )
    op.create_table(
        "task_log_try",
        sa.Column("task_instance_id", sa.BigInteger(), nullable=False),
        sa.Column("try_number", sa.Integer(), nullable=False),
        sa.Column("bytes", sa.BigInteger(), server_default=sa.text("0"), nullable=False),
        sa.Column("cut", sa.Boolean(), server_default=sa.text("false"), nullable=False),
        sa.ForeignKeyConstraint(
            ["task_instance_id"],
            ["task_instance.id"],
            name=op.f("fk_task_log_try_task_instance_id_task_instance"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("task_instance_id", "try_number", name=op.f("pk_task_log_try")),
    )


def downgrade() -> None:
    op.drop_table("task_log_try")
    op.drop_index(op.f("ix_task_log_task_instance_id_try_number_id"), table_name="task_log")
    op.drop_table("task_log")
