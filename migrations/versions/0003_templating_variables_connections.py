"""templating, Variables and Connections: variable, connection, rendered_task_instance_fields

Revision ID: 0003
Revises: 0002
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def _id() -> sa.Column:
    return sa.Column("id", sa.BigInteger(), sa.Identity(always=False), nullable=False)


def upgrade() -> None:
    op.create_table(
        "variable",
        _id(),
        sa.Column("key", sa.String(length=250), nullable=False),
        sa.Column("val", sa.Text(), nullable=True),
        sa.Column("description", sa.Text(), nullable=True),
        sa.Column("is_encrypted", sa.Boolean(), server_default=sa.text("false"), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_variable")),
        sa.UniqueConstraint("key", name=op.f("uq_variable_key")),
    )
    op.create_table(
        "connection",
        _id(),
        sa.Column("conn_id", sa.String(length=250), nullable=False),
        sa.Column("conn_type", sa.String(length=500), nullable=False),
        sa.Column("description", sa.Text(), nullable=True),
        sa.Column("host", sa.String(length=500), nullable=True),
        sa.Column("schema", sa.String(length=500), nullable=True),
        sa.Column("login", sa.Text(), nullable=True),
        sa.Column("password", sa.Text(), nullable=True),
        sa.Column("port", sa.Integer(), nullable=True),
        sa.Column("extra", sa.Text(), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_connection")),
        sa.UniqueConstraint("conn_id", name=op.f("uq_connection_conn_id")),
    )
    op.create_table(
        "rendered_task_instance_fields",
        sa.Column("task_instance_id", sa.BigInteger(), nullable=False),
        sa.Column("try_number", sa.Integer(), nullable=False),
        sa.Column("rendered", postgresql.JSON(astext_type=sa.Text()), nullable=False),
        sa.Column(
            "rendered_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("now()"),
            nullable=False,
        ),
        sa.ForeignKeyConstraint(
            ["task_instance_id"],
            ["task_instance.id"],
            name=op.f("fk_rendered_task_instance_fields_task_instance_id_task_instance"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint(
            "task_instance_id", "try_number", name=op.f("pk_rendered_task_instance_fields")
        ),
    )


def downgrade() -> None:
    op.drop_table("rendered_task_instance_fields")
    op.drop_table("connection")
    op.drop_table("variable")
