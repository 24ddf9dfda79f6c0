"""Many waiting runs: the queued and running runs of each DAG kept as counts as they change
(``dag_run_count``, written by triggers on ``dag_run``), an index of queued runs per DAG for
the start pass, one of automated runs per DAG for its latest, and an index of shared triggers
by id for the unwaited-trigger sweep
(scheduler/DECISIONS.md 27)

Revision ID: 0022_waitruns_counts
Revises: 0021_fartimers
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0022_waitruns_counts"
down_revision = "0021_fartimers"
branch_labels = None
depends_on = None

# A change of a run into or out of queued or running adds a row of +1 or -1 for that state.
# Row triggers with WHEN conditions: an update that leaves the state alone (a run marked for
# evaluation, on every task's end) calls no function.
_COUNT_FUNCTION = """
CREATE FUNCTION dag_run_count_change() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP <> 'INSERT' AND OLD.state IN ('queued', 'running') THEN
        INSERT INTO dag_run_count (dag_id, state, delta) VALUES (OLD.dag_id, OLD.state, -1);
    END IF;
    IF TG_OP <> 'DELETE' AND NEW.state IN ('queued', 'running') THEN
        INSERT INTO dag_run_count (dag_id, state, delta) VALUES (NEW.dag_id, NEW.state, 1);
    END IF;
    RETURN NULL;
END
$$
"""

_TRIGGERS = {
    "dag_run_count_insert": "AFTER INSERT ON dag_run FOR EACH ROW"
    " WHEN (NEW.state IN ('queued', 'running'))",
    "dag_run_count_update": "AFTER UPDATE OF state, dag_id ON dag_run FOR EACH ROW"
    " WHEN ((OLD.state, OLD.dag_id) IS DISTINCT FROM (NEW.state, NEW.dag_id)"
    " AND (OLD.state IN ('queued', 'running') OR NEW.state IN ('queued', 'running')))",
    "dag_run_count_delete": "AFTER DELETE ON dag_run FOR EACH ROW"
    " WHEN (OLD.state IN ('queued', 'running'))",
}


def upgrade() -> None:
    op.create_table(
        "dag_run_count",
        sa.Column("id", sa.BigInteger(), sa.Identity(), nullable=False),
        sa.Column("dag_id", sa.String(250), nullable=False),
        sa.Column("state", sa.String(20), nullable=False),
        sa.Column("delta", sa.Integer(), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_dag_run_count"),
    )
    op.create_index("ix_dag_run_count_dag_id", "dag_run_count", ["dag_id"])
    op.execute(_COUNT_FUNCTION)
    # The triggers first: creating one locks out writes to dag_run until this migration
    # commits, so the counts taken next miss no change.
    for name, when in _TRIGGERS.items():
        op.execute(f"CREATE TRIGGER {name} {when} EXECUTE FUNCTION dag_run_count_change()")
    op.execute(
        "INSERT INTO dag_run_count (dag_id, state, delta)"
        " SELECT dag_id, state, count(*) FROM dag_run"
        " WHERE state IN ('queued', 'running') GROUP BY dag_id, state"
    )
    op.create_index(
        "ix_dag_run_queued",
        "dag_run",
        ["dag_id", "logical_date", "id"],
        postgresql_where=sa.text("state = 'queued'"),
    )
    op.create_index(
        "ix_dag_run_automated",
        "dag_run",
        ["dag_id", "logical_date"],
        postgresql_where=sa.text("run_type IN ('backfill', 'scheduled')"),
    )
    op.create_index(
        "ix_trigger_shared_id",
        "trigger",
        ["id"],
        postgresql_where=sa.text("share_key IS NOT NULL"),
    )


def downgrade() -> None:
    op.drop_index("ix_trigger_shared_id", table_name="trigger")
    op.drop_index("ix_dag_run_automated", table_name="dag_run")
    op.drop_index("ix_dag_run_queued", table_name="dag_run")
    for name in _TRIGGERS:
        op.execute(f"DROP TRIGGER {name} ON dag_run")
    op.execute("DROP FUNCTION dag_run_count_change()")
    op.drop_index("ix_dag_run_count_dag_id", table_name="dag_run_count")
    op.drop_table("dag_run_count")
