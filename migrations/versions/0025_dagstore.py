"""The parsed DAGs the web UI and the CLI read (readmodel/DECISIONS.md 5): one serialized
document per DAG, written by the schedulers after each parse, and when a folder was last parsed

Revision ID: 0025_dagstore
Revises: 0024_composite
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import JSONB

revision = "0025_dagstore"
down_revision = "0024_composite"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "serialized_dag",
        sa.Column("dag_id", sa.String(250), nullable=False),
        sa.Column("fileloc", sa.Text(), nullable=False),
        sa.Column("data", JSONB(), nullable=False),
        sa.Column("dag_hash", sa.String(64), nullable=False),
        sa.Column(
            "updated_at", sa.DateTime(timezone=True), server_default=sa.func.now(), nullable=False
        ),
        sa.PrimaryKeyConstraint("dag_id", name="pk_serialized_dag"),
    )
    op.create_table(
        "dag_folder_parse",
        sa.Column("folder", sa.Text(), nullable=False),
        sa.Column(
            "parsed_at", sa.DateTime(timezone=True), server_default=sa.func.now(), nullable=False
        ),
        sa.PrimaryKeyConstraint("folder", name="pk_dag_folder_parse"),
    )


def downgrade() -> None:
    op.drop_table("dag_folder_parse")
    op.drop_table("serialized_dag")
