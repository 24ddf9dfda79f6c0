"""Indexes the read model's lists are paged by (readmodel/DECISIONS.md 4): deferred task
instances by trigger, a DAG's task instances newest first, runs by logical date

Revision ID: 0023_readmodel_list_order
Revises: 0022_waitruns_counts
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0023_readmodel_list_order"
down_revision = "0022_waitruns_counts"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_index(
        "ix_task_instance_deferred_order",
        "task_instance",
        ["trigger_id", "id"],
        postgresql_where=sa.text("state = 'deferred'"),
    )
    op.create_index("ix_task_instance_dag_id_id", "task_instance", ["dag_id", "id"])
    op.create_index("ix_dag_run_logical_date_id", "dag_run", ["logical_date", "id"])


def downgrade() -> None:
    op.drop_index("ix_dag_run_logical_date_id", table_name="dag_run")
    op.drop_index("ix_task_instance_dag_id_id", table_name="task_instance")
    op.drop_index("ix_task_instance_deferred_order", table_name="task_instance")
