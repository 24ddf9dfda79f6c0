"""core at scale: dag, import_error and worker tables; change-driven run evaluation; due tasks

Revision ID: 0002
Revises: 0001
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None

_NOW = sa.text("now()")


def _timestamp(name: str, *, default: bool = False) -> sa.Column:
    if default:
        return sa.Column(name, sa.DateTime(timezone=True), server_default=_NOW, nullable=False)
    return sa.Column(name, sa.DateTime(timezone=True), nullable=True)


def upgrade() -> None:
    op.create_table(
        "dag",
        sa.Column("dag_id", sa.String(length=250), nullable=False),
        sa.Column("fileloc", sa.Text(), nullable=True),
        sa.Column("is_paused", sa.Boolean(), server_default=sa.text("false"), nullable=False),
        sa.Column("is_active", sa.Boolean(), server_default=sa.text("true"), nullable=False),
        sa.Column("schedule", sa.Text(), nullable=True),
        sa.Column("max_active_tasks", sa.Integer(), server_default=sa.text("16"), nullable=False),
        sa.Column("max_active_runs", sa.Integer(), server_default=sa.text("16"), nullable=False),
        _timestamp("next_dagrun"),
        _timestamp("next_dagrun_data_interval_start"),
        _timestamp("next_dagrun_data_interval_end"),
        _timestamp("next_dagrun_create_after"),
        _timestamp("missing_since"),
        sa.Column("missing_reason", sa.Text(), nullable=True),
        _timestamp("last_parsed_at"),
        sa.PrimaryKeyConstraint("dag_id", name=op.f("pk_dag")),
    )
    op.create_table(
        "import_error",
        sa.Column("filename", sa.String(length=1000), nullable=False),
        sa.Column("error", sa.Text(), nullable=False),
        _timestamp("first_seen", default=True),
        _timestamp("last_seen", default=True),
        sa.PrimaryKeyConstraint("filename", name=op.f("pk_import_error")),
    )
    op.create_table(
        "worker",
        sa.Column("name", sa.String(length=250), nullable=False),
        sa.Column("hostname", sa.String(length=1000), nullable=False),
        sa.Column("pid", sa.Integer(), nullable=False),
        sa.Column("queue", sa.String(length=256), nullable=False),
        sa.Column("concurrency", sa.Integer(), nullable=False),
        sa.Column("load", sa.Integer(), server_default=sa.text("0"), nullable=False),
        _timestamp("started_at", default=True),
        _timestamp("latest_heartbeat", default=True),
        sa.Column("state", sa.String(length=20), nullable=False),
        sa.PrimaryKeyConstraint("name", name=op.f("pk_worker")),
    )
    op.add_column(
        "dag_run",
        sa.Column(
            "run_type", sa.String(length=20), server_default=sa.text("'manual'"), nullable=False
        ),
    )
    op.add_column("dag_run", _timestamp("data_interval_start"))
    op.add_column("dag_run", _timestamp("data_interval_end"))
    op.add_column("dag_run", _timestamp("evaluate_after"))
    op.add_column("dag_run", sa.Column("scheduling_error", sa.Text(), nullable=True))
    op.create_index(
        "ix_dag_run_evaluate_after",
        "dag_run",
        ["evaluate_after"],
        unique=False,
        postgresql_where=sa.text("evaluate_after IS NOT NULL"),
    )
    # Running runs created before this revision are evaluated once, as the old scheduler did.
    op.execute("UPDATE dag_run SET evaluate_after = now() WHERE state IN ('queued', 'running')")
    op.add_column("task_instance", _timestamp("due_at"))
    op.create_index(
        "ix_task_instance_due",
        "task_instance",
        ["due_at"],
        unique=False,
        postgresql_where=sa.text("state IN ('up_for_retry', 'up_for_reschedule')"),
    )
    op.create_index("ix_task_instance_state_id", "task_instance", ["state", "id"], unique=False)
    op.create_index(
        op.f("ix_resume_event_received_at"), "resume_event", ["received_at"], unique=False
    )
    op.create_index(
        "ix_outbox_published",
        "outbox",
        ["published_at"],
        unique=False,
        postgresql_where=sa.text("published_at IS NOT NULL"),
    )


def downgrade() -> None:
    op.drop_index("ix_outbox_published", table_name="outbox")
    op.drop_index(op.f("ix_resume_event_received_at"), table_name="resume_event")
    op.drop_index("ix_task_instance_state_id", table_name="task_instance")
    op.drop_index("ix_task_instance_due", table_name="task_instance")
    op.drop_column("task_instance", "due_at")
    op.drop_index("ix_dag_run_evaluate_after", table_name="dag_run")
    for column in (
        "scheduling_error",
        "evaluate_after",
        "data_interval_end",
        "data_interval_start",
        "run_type",
    ):
        op.drop_column("dag_run", column)
    op.drop_table("worker")
    op.drop_table("import_error")
    op.drop_table("dag")
