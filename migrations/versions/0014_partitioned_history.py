"""task_state_change, task_log, resume_event: range-partitioned by day, so that retention drops
whole partitions instead of deleting rows (deferral.store.partitions)

The table as it was becomes one partition, ``<table>_beforeYYYYMMDD``, holding everything before
tomorrow (UTC): no row is copied, PostgreSQL only checks the range and builds the new indexes.
Beside it: a default partition and a partition per day from tomorrow on. The primary keys gain
the partition key (PostgreSQL requires it): (id, at) and (dedup_key, received_at); ids come from
a sequence, as a partitioned table has no identity column before PostgreSQL 17.

Revision ID: 0014
Revises: 0013
"""

from __future__ import annotations

import datetime as dt

from alembic import op
from sqlalchemy import text

revision = "0014"
down_revision = "0013"
branch_labels = None
depends_on = None

AHEAD_DAYS = 3  # deferral.store.partitions.AHEAD_DAYS when this was written

# table: (partition key, the primary key's other column, whether ids come from a sequence,
# indexes (name, columns), the foreign key to task_instance or None)
TABLES = {
    "task_state_change": (
        "at",
        "id",
        [("ix_task_state_change_task_instance_id", "task_instance_id")],
        "fk_task_state_change_task_instance_id_task_instance",
    ),
    "task_log": (
        "at",
        "id",
        [("ix_task_log_task_instance_id_try_number_id", "task_instance_id, try_number, id")],
        "fk_task_log_task_instance_id_task_instance",
    ),
    "resume_event": (
        "received_at",
        "dedup_key",
        [
            ("ix_resume_event_trigger_id", "trigger_id"),
            ("ix_resume_event_received_at", "received_at"),
        ],
        None,
    ),
}


def _bound(day: dt.date) -> str:
    return f"'{day.isoformat()} 00:00:00+00'"


def upgrade() -> None:
    tomorrow = dt.datetime.now(dt.UTC).date() + dt.timedelta(days=1)
    for table, (key, column, indexes, fk) in TABLES.items():
        old = f"{table}_before{tomorrow:%Y%m%d}"
        for name, _ in indexes:
            op.execute(f"DROP INDEX {name}")
        op.execute(f"ALTER TABLE {table} DROP CONSTRAINT pk_{table}")
        if fk is not None:
            op.execute(f"ALTER TABLE {table} DROP CONSTRAINT {fk}")
        if column == "id":
            # The identity's sequence goes with it: the new one starts past every id given.
            following = op.get_bind().scalar(
                text(f"SELECT nextval(pg_get_serial_sequence('{table}', 'id'))")
            )
            op.execute(f"ALTER TABLE {table} ALTER COLUMN id DROP IDENTITY")
            op.execute(f"CREATE SEQUENCE {table}_id_seq AS bigint")
            op.execute(f"SELECT setval('{table}_id_seq', {following}, false)")
        op.execute(f"ALTER TABLE {table} RENAME TO {old}")
        op.execute(
            f"CREATE TABLE {table} (LIKE {old} INCLUDING DEFAULTS) PARTITION BY RANGE ({key})"
        )
        if column == "id":
            op.execute(f"ALTER TABLE {table} ALTER COLUMN id SET DEFAULT nextval('{table}_id_seq')")
            op.execute(f"ALTER SEQUENCE {table}_id_seq OWNED BY {table}.id")
        op.execute(f"ALTER TABLE {table} ADD CONSTRAINT pk_{table} PRIMARY KEY ({column}, {key})")
        for name, columns in indexes:
            op.execute(f"CREATE INDEX {name} ON {table} ({columns})")
        if fk is not None:
            op.execute(
                f"ALTER TABLE {table} ADD CONSTRAINT {fk} FOREIGN KEY (task_instance_id)"
                " REFERENCES task_instance (id) ON DELETE CASCADE"
            )
        op.execute(f"CREATE TABLE {table}_default PARTITION OF {table} DEFAULT")
        for offset in range(AHEAD_DAYS + 1):
            day = tomorrow + dt.timedelta(days=offset)
            op.execute(
                f"CREATE TABLE {table}_p{day:%Y%m%d} PARTITION OF {table}"
                f" FOR VALUES FROM ({_bound(day)}) TO ({_bound(day + dt.timedelta(days=1))})"
            )
        # Rows stamped after today (a writer's clock ahead) go to their partitions first.
        op.execute(
            f"""WITH moved AS (DELETE FROM {old} WHERE {key} >= {_bound(tomorrow)} RETURNING *)
            INSERT INTO {table} SELECT * FROM moved"""
        )
        op.execute(
            f"ALTER TABLE {table} ATTACH PARTITION {old}"
            f" FOR VALUES FROM (MINVALUE) TO ({_bound(tomorrow)})"
        )


def downgrade() -> None:
    for table, (key, column, indexes, fk) in TABLES.items():
        flat = f"{table}_flat"
        op.execute(f"CREATE TABLE {flat} (LIKE {table} INCLUDING DEFAULTS)")
        # A dedup key claimed twice (deferral.store.partitions: it is unique per day) keeps its
        # first.
        op.execute(
            f"INSERT INTO {flat} SELECT DISTINCT ON ({column}) * FROM {table}"
            f" ORDER BY {column}, {key}"
        )
        if column == "id":
            following = op.get_bind().scalar(text(f"SELECT nextval('{table}_id_seq')"))
            op.execute(f"ALTER TABLE {flat} ALTER COLUMN id DROP DEFAULT")
        op.execute(f"DROP TABLE {table}")  # its partitions and its sequence with it
        op.execute(f"ALTER TABLE {flat} RENAME TO {table}")
        if column == "id":
            op.execute(
                f"ALTER TABLE {table} ALTER COLUMN id ADD GENERATED BY DEFAULT AS IDENTITY"
                f" (START WITH {following})"
            )
        op.execute(f"ALTER TABLE {table} ADD CONSTRAINT pk_{table} PRIMARY KEY ({column})")
        for name, columns in indexes:
            op.execute(f"CREATE INDEX {name} ON {table} ({columns})")
        if fk is not None:
            op.execute(
                f"ALTER TABLE {table} ADD CONSTRAINT {fk} FOREIGN KEY (task_instance_id)"
                " REFERENCES task_instance (id) ON DELETE CASCADE"
            )
