"""schedules: one run per logical date, due-DAG and active-run indexes

Revision ID: 0004
Revises: 0003
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # Scheduler replicas insert scheduled runs with ON CONFLICT DO NOTHING on this key.
    op.create_unique_constraint(
        op.f("uq_dag_run_dag_id_logical_date"), "dag_run", ["dag_id", "logical_date"]
    )
    op.create_index(op.f("ix_dag_run_dag_id_state"), "dag_run", ["dag_id", "state"], unique=False)
    op.create_index(
        "ix_dag_next_dagrun_create_after",
        "dag",
        ["next_dagrun_create_after"],
        unique=False,
        postgresql_where=sa.text("next_dagrun_create_after IS NOT NULL"),
    )


def downgrade() -> None:
    op.drop_index("ix_dag_next_dagrun_create_after", table_name="dag")
    op.drop_index(op.f("ix_dag_run_dag_id_state"), table_name="dag_run")
    op.drop_constraint(op.f("uq_dag_run_dag_id_logical_date"), "dag_run", type_="unique")
