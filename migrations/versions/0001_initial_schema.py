"""initial schema

Revision ID: 0001
Revises:
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "dag_run",
        sa.Column("id", sa.BigInteger(), sa.Identity(always=False), nullable=False),
        sa.Column("dag_id", sa.String(length=250), nullable=False),
        sa.Column("run_id", sa.String(length=250), nullable=False),
        sa.Column("logical_date", sa.DateTime(timezone=True), nullable=False),
        sa.Column("state", sa.String(length=20), nullable=False),
        sa.Column(
            "conf",
            postgresql.JSONB(astext_type=sa.Text()),
            server_default=sa.text("'{}'::jsonb"),
            nullable=False,
        ),
        sa.Column(
            "created_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("now()"),
            nullable=False,
        ),
        sa.Column("start_date", sa.DateTime(timezone=True), nullable=True),
        sa.Column("end_date", sa.DateTime(timezone=True), nullable=True),
        sa.Column(
            "updated_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("now()"),
            nullable=False,
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_dag_run")),
        sa.UniqueConstraint("dag_id", "run_id", name=op.f("uq_dag_run_dag_id_run_id")),
    )
    op.create_index(op.f("ix_dag_run_state"), "dag_run", ["state"], unique=False)
    op.create_table(
        "outbox",
        sa.Column("id", sa.BigInteger(), sa.Identity(always=False), nullable=False),
        sa.Column("stream", sa.String(length=250), nullable=False),
        sa.Column("fields", postgresql.JSONB(astext_type=sa.Text()), nullable=False),
        sa.Column(
            "created_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("now()"),
            nullable=False,
        ),
        sa.Column("published_at", sa.DateTime(timezone=True), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_outbox")),
    )
    op.create_index(
        "ix_outbox_unpublished",
        "outbox",
        ["created_at"],
        unique=False,
        postgresql_where=sa.text("published_at IS NULL"),
    )
    pool = op.create_table(
        "pool",
        sa.Column("name", sa.String(length=256), nullable=False),
        sa.Column("slots", sa.Integer(), nullable=False),
        sa.Column(
            "include_deferred", sa.Boolean(), server_default=sa.text("false"), nullable=False
        ),
        sa.Column("description", sa.Text(), nullable=True),
        sa.PrimaryKeyConstraint("name", name=op.f("pk_pool")),
    )
    # Every task belongs to a pool; default_pool is where tasks go unless they name another.
    op.bulk_insert(pool, [{"name": "default_pool", "slots": 128, "description": "Default pool"}])
    op.create_table(
        "resume_event",
        sa.Column("dedup_key", sa.String(length=250), nullable=False),
        sa.Column("trigger_id", sa.BigInteger(), nullable=False),
        sa.Column("task_instance_id", sa.BigInteger(), nullable=True),
        sa.Column("outcome", sa.String(length=20), nullable=False),
        sa.Column(
            "received_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("now()"),
            nullable=False,
        ),
        sa.PrimaryKeyConstraint("dedup_key", name=op.f("pk_resume_event")),
    )
    op.create_index(
        op.f("ix_resume_event_trigger_id"), "resume_event", ["trigger_id"], unique=False
    )
    op.create_table(
        "trigger",
        sa.Column("id", sa.BigInteger(), sa.Identity(always=False), nullable=False),
        sa.Column("classpath", sa.String(length=1000), nullable=False),
        sa.Column("kwargs", sa.Text(), nullable=False),
        sa.Column("fingerprint", sa.String(length=64), nullable=False),
        sa.Column(
            "created_date",
            sa.DateTime(timezone=True),
            server_default=sa.text("now()"),
            nullable=False,
        ),
        sa.Column("triggerer_id", sa.String(length=250), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_trigger")),
    )
    op.create_index(op.f("ix_trigger_fingerprint"), "trigger", ["fingerprint"], unique=False)
    op.create_table(
        "triggerer",
        sa.Column("name", sa.String(length=250), nullable=False),
        sa.Column("hostname", sa.String(length=1000), nullable=False),
        sa.Column("pid", sa.Integer(), nullable=False),
        sa.Column("capacity", sa.Integer(), nullable=False),
        sa.Column("load", sa.Integer(), server_default=sa.text("0"), nullable=False),
        sa.Column(
            "started_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("now()"),
            nullable=False,
        ),
        sa.Column(
            "latest_heartbeat",
            sa.DateTime(timezone=True),
            server_default=sa.text("now()"),
            nullable=False,
        ),
        sa.Column("state", sa.String(length=20), nullable=False),
        sa.PrimaryKeyConstraint("name", name=op.f("pk_triggerer")),
    )
    op.create_table(
        "task_instance",
        sa.Column("id", sa.BigInteger(), sa.Identity(always=False), nullable=False),
        sa.Column("dag_id", sa.String(length=250), nullable=False),
        sa.Column("run_id", sa.String(length=250), nullable=False),
        sa.Column("task_id", sa.String(length=250), nullable=False),
        sa.Column("map_index", sa.Integer(), server_default=sa.text("-1"), nullable=False),
        sa.Column("state", sa.String(length=20), server_default=sa.text("'none'"), nullable=False),
        sa.Column("try_number", sa.Integer(), server_default=sa.text("0"), nullable=False),
        sa.Column("max_tries", sa.Integer(), server_default=sa.text("0"), nullable=False),
        sa.Column(
            "pool", sa.String(length=256), server_default=sa.text("'default_pool'"), nullable=False
        ),
        sa.Column("pool_slots", sa.Integer(), server_default=sa.text("1"), nullable=False),
        sa.Column(
            "queue", sa.String(length=256), server_default=sa.text("'default'"), nullable=False
        ),
        sa.Column("priority_weight", sa.Integer(), server_default=sa.text("1"), nullable=False),
        sa.Column("hostname", sa.String(length=1000), nullable=True),
        sa.Column("worker", sa.String(length=1000), nullable=True),
        sa.Column("start_date", sa.DateTime(timezone=True), nullable=True),
        sa.Column("end_date", sa.DateTime(timezone=True), nullable=True),
        sa.Column("queued_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("trigger_id", sa.BigInteger(), nullable=True),
        sa.Column("next_method", sa.String(length=1000), nullable=True),
        sa.Column("next_kwargs", sa.Text(), nullable=True),
        sa.Column("trigger_timeout", sa.DateTime(timezone=True), nullable=True),
        sa.Column("first_started_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column(
            "updated_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("now()"),
            nullable=False,
        ),
        sa.ForeignKeyConstraint(
            ["trigger_id"], ["trigger.id"], name=op.f("fk_task_instance_trigger_id_trigger")
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_task_instance")),
        sa.UniqueConstraint(
            "dag_id",
            "run_id",
            "task_id",
            "map_index",
            name=op.f("uq_task_instance_dag_id_run_id_task_id_map_index"),
        ),
    )
    op.create_index(
        "ix_task_instance_deferred_timeout",
        "task_instance",
        ["trigger_timeout"],
        unique=False,
        postgresql_where=sa.text("state = 'deferred'"),
    )
    op.create_index(
        op.f("ix_task_instance_state_queue_priority_weight"),
        "task_instance",
        ["state", "queue", "priority_weight"],
        unique=False,
    )
    op.create_index(
        op.f("ix_task_instance_trigger_id"), "task_instance", ["trigger_id"], unique=False
    )
    op.create_table(
        "task_reschedule",
        sa.Column("id", sa.BigInteger(), sa.Identity(always=False), nullable=False),
        sa.Column("task_instance_id", sa.BigInteger(), nullable=False),
        sa.Column("try_number", sa.Integer(), nullable=False),
        sa.Column("start_date", sa.DateTime(timezone=True), nullable=False),
        sa.Column("end_date", sa.DateTime(timezone=True), nullable=False),
        sa.Column("reschedule_date", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["task_instance_id"],
            ["task_instance.id"],
            name=op.f("fk_task_reschedule_task_instance_id_task_instance"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_task_reschedule")),
    )
    op.create_index(
        op.f("ix_task_reschedule_task_instance_id"),
        "task_reschedule",
        ["task_instance_id"],
        unique=False,
    )
    op.create_table(
        "task_state_change",
        sa.Column("id", sa.BigInteger(), sa.Identity(always=False), nullable=False),
        sa.Column("task_instance_id", sa.BigInteger(), nullable=False),
        sa.Column("from_state", sa.String(length=20), nullable=False),
        sa.Column("to_state", sa.String(length=20), nullable=False),
        sa.Column(
            "at",
            sa.DateTime(timezone=True),
            server_default=sa.text("clock_timestamp()"),
            nullable=False,
        ),
        sa.Column("reason", sa.Text(), nullable=True),
        sa.ForeignKeyConstraint(
            ["task_instance_id"],
            ["task_instance.id"],
            name=op.f("fk_task_state_change_task_instance_id_task_instance"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_task_state_change")),
    )
    op.create_index(
        op.f("ix_task_state_change_task_instance_id"),
        "task_state_change",
        ["task_instance_id"],
        unique=False,
    )
    op.create_table(
        "xcom",
        sa.Column("task_instance_id", sa.BigInteger(), nullable=False),
        sa.Column("key", sa.String(length=512), nullable=False),
        sa.Column("value", postgresql.JSONB(astext_type=sa.Text()), nullable=False),
        sa.Column(
            "created_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("now()"),
            nullable=False,
        ),
        sa.ForeignKeyConstraint(
            ["task_instance_id"],
            ["task_instance.id"],
            name=op.f("fk_xcom_task_instance_id_task_instance"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("task_instance_id", "key", name=op.f("pk_xcom")),
    )


def downgrade() -> None:
    op.drop_table("xcom")
    op.drop_index(op.f("ix_task_state_change_task_instance_id"), table_name="task_state_change")
    op.drop_table("task_state_change")
    op.drop_index(op.f("ix_task_reschedule_task_instance_id"), table_name="task_reschedule")
    op.drop_table("task_reschedule")
    op.drop_index(op.f("ix_task_instance_trigger_id"), table_name="task_instance")
    op.drop_index(op.f("ix_task_instance_state_queue_priority_weight"), table_name="task_instance")
    op.drop_index(
        "ix_task_instance_deferred_timeout",
        table_name="task_instance",
        postgresql_where=sa.text("state = 'deferred'"),
    )
    op.drop_table("task_instance")
    op.drop_table("triggerer")
    op.drop_index(op.f("ix_trigger_fingerprint"), table_name="trigger")
    op.drop_table("trigger")
    op.drop_index(op.f("ix_resume_event_trigger_id"), table_name="resume_event")
    op.drop_table("resume_event")
    op.drop_table("pool")
    op.drop_index(
        "ix_outbox_unpublished",
        table_name="outbox",
        postgresql_where=sa.text("published_at IS NULL"),
    )
    op.drop_table("outbox")
    op.drop_index(op.f("ix_dag_run_state"), table_name="dag_run")
    op.drop_table("dag_run")
