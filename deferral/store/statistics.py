"""The planner's statistics of the tables the hot paths read, kept current by the scheduler.

A catch-up or a burst of triggers adds tens of thousands of runs, task instances and triggers
within minutes; until the next ANALYZE the planner believes the tables hold what they held
before (autovacuum analyzes a table once a tenth of it changed, and may be off or behind), and
chose plans such as a nested loop over 11,908 running runs estimated at 10, or a bitmap scan of
every deferred task for a page of 20. The scheduler analyzes a table once it changed by more
than a fifth (at least 1,000 rows) since its last analysis: ANALYZE reads a fixed-size sample
(30,000 rows at the default statistics target), not the table.

``dag_run_count`` is written a row per run change and folded by deletes, so its index fills with
entries of deleted rows that every count then reads until a vacuum: the scheduler vacuums it
once it holds more dead rows than live ones (and 1,000), without waiting for autovacuum.
"""

from __future__ import annotations

from sqlalchemy import Engine, text
from sqlalchemy.orm import Session, sessionmaker

# The tables whose plans the scheduler's, workers' and triggerer's statements depend on.
TABLES = ("dag_run", "task_instance", "trigger", "dag_run_count")
MIN_CHANGES = 1000
CHANGED_FRACTION = 0.2
# The advisory lock (pg_try_advisory_xact_lock's key) of whoever analyzes: one replica at a time.
LOCK_KEY = 0x6465_6672_616E_6C7A  # "defranlz"

# The most changed of TABLES past the threshold, if any (the activity statistics' counts).
_CHANGED_SQL = text(
    """
    SELECT relname FROM pg_stat_user_tables
    WHERE schemaname = current_schema() AND relname = ANY(CAST(:tables AS text[]))
        AND n_mod_since_analyze > greatest(:least, :fraction * n_live_tup)
    ORDER BY n_mod_since_analyze DESC
    LIMIT 1
    """
)


def analyze_changed(sessions: sessionmaker[Session]) -> str | None:
    """Analyze the most changed of TABLES if it changed enough since its last analysis (one
    table per call, so a call never holds its caller long); returns its name. Another replica
    analyzing meanwhile: nothing."""
    with sessions.begin() as session:
        params = {"tables": list(TABLES), "least": MIN_CHANGES, "fraction": CHANGED_FRACTION}
        table = session.scalar(_CHANGED_SQL, params)
        if table not in TABLES:
            return None
        if not session.scalar(text("SELECT pg_try_advisory_xact_lock(:key)"), {"key": LOCK_KEY}):
            return None
        session.execute(text(f"ANALYZE {table}"))  # a name from TABLES, never from input
    return str(table)


# dag_run_count, when it holds more dead rows than live ones (and MIN_CHANGES).
_COUNTS_DEAD_SQL = text(
    """
    SELECT n_dead_tup > greatest(:least, n_live_tup) FROM pg_stat_user_tables
    WHERE schemaname = current_schema() AND relname = 'dag_run_count'
    """
)


def vacuum_counts(engine: Engine) -> bool:
    """Vacuum ``dag_run_count`` if its folds left more dead rows than live ones; whether it
    did. A replica vacuuming it meanwhile: nothing (VACUUM never runs in a transaction, so the
    advisory lock is not used; SKIP_LOCKED does not wait for the other)."""
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        if not conn.scalar(_COUNTS_DEAD_SQL, {"least": MIN_CHANGES}):
            return False
        conn.execute(text("VACUUM (SKIP_LOCKED) dag_run_count"))
    return True
