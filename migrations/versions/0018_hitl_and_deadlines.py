"""hitl_detail: what a task awaiting input asks and the response; deadline_miss: DAG runs that
had not finished by their DeadlineAlert's deadline

Revision ID: 0018
Revises: 0013
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

TIMESTAMP = sa.DateTime(timezone=True)
NOW = sa.func.now()

revision = "0018"
down_revision = "0013"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "hitl_detail",
        sa.Column("task_instance_id", sa.BigInteger(), nullable=False),
        sa.Column("try_number", sa.Integer(), nullable=False),
        sa.Column("subject", sa.Text(), nullable=False),
        sa.Column("body", sa.Text(), nullable=True),
        sa.Column("options", postgresql.JSONB(), nullable=False),
        sa.Column("defaults", postgresql.JSONB(), nullable=True),
        sa.Column("multiple", sa.Boolean(), server_default=sa.text("false"), nullable=False),
        sa.Column(
            "params", postgresql.JSONB(), server_default=sa.text("'{}'::jsonb"), nullable=False
        ),
        sa.Column("created_at", TIMESTAMP, server_default=NOW, nullable=False),
        sa.Column("timeout_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("responded_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("responded_by", sa.String(64), nullable=True),
        sa.Column("chosen_options", postgresql.JSONB(), nullable=True),
        sa.Column("params_input", postgresql.JSONB(), nullable=True),
        sa.ForeignKeyConstraint(
            ["task_instance_id"],
            ["task_instance.id"],
            name="fk_hitl_detail_task_instance_id_task_instance",
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("task_instance_id", name="pk_hitl_detail"),
    )
    op.create_index(
        "ix_hitl_detail_open_timeout",
        "hitl_detail",
        ["timeout_at"],
        postgresql_where=sa.text("responded_at IS NULL AND timeout_at IS NOT NULL"),
    )
    op.create_table(
        "deadline_miss",
        sa.Column("id", sa.BigInteger(), sa.Identity(), nullable=False),
        sa.Column("dag_run_id", sa.BigInteger(), nullable=False),
        sa.Column("dag_id", sa.String(250), nullable=False),
        sa.Column("run_id", sa.String(250), nullable=False),
        sa.Column("alert_index", sa.Integer(), server_default=sa.text("0"), nullable=False),
        sa.Column("deadline", sa.DateTime(timezone=True), nullable=False),
        sa.Column("missed_at", TIMESTAMP, server_default=NOW, nullable=False),
        sa.Column("callback_state", sa.Text(), server_default=sa.text("'pending'"), nullable=False),
        sa.ForeignKeyConstraint(
            ["dag_run_id"],
            ["dag_run.id"],
            name="fk_deadline_miss_dag_run_id_dag_run",
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name="pk_deadline_miss"),
        sa.UniqueConstraint(
            "dag_run_id", "alert_index", name="uq_deadline_miss_dag_run_id_alert_index"
        ),
    )
    op.create_index("ix_deadline_miss_dag_id", "deadline_miss", ["dag_id"])


def downgrade() -> None:
    op.drop_index("ix_deadline_miss_dag_id", table_name="deadline_miss")
    op.drop_table("deadline_miss")
    op.drop_index("ix_hitl_detail_open_timeout", table_name="hitl_detail")
    op.drop_table("hitl_detail")
