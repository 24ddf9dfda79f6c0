"""What the scheduler and the CLI read alike about a DAG's scheduled runs: the data interval of
its latest automated (scheduled or backfill) run, from which its next run follows."""

from __future__ import annotations

import datetime as dt
from collections.abc import Collection
from typing import Protocol

from sqlalchemy import bindparam, text
from sqlalchemy.dialects.postgresql import ARRAY
from sqlalchemy.orm import Session
from sqlalchemy.types import String

from deferral.states import AUTOMATED_RUN_TYPES
from deferral.timetables import DagRunInfo, DataInterval

# The automated run types as the partial index ix_dag_run_automated spells them: written into
# the statement, so that the planner matches the index whatever plan it keeps.
AUTOMATED_IN = "run_type IN (" + ", ".join(f"'{t}'" for t in sorted(AUTOMATED_RUN_TYPES)) + ")"

# One index probe per DAG (ix_dag_run_automated, backwards), whatever the number of runs: the
# unique (dag_id, logical_date) key walked past every manual run newer than the latest
# automated one (10,000 triggered runs: 10,000 rows a parse, and a due DAG's every check).
_LATEST_AUTOMATED_SQL = text(
    f"""
    SELECT d.dag_id, r.logical_date, r.data_interval_start, r.data_interval_end
    FROM unnest(:dag_ids) AS d(dag_id)
    CROSS JOIN LATERAL (
        SELECT logical_date, data_interval_start, data_interval_end FROM dag_run
        WHERE dag_run.dag_id = d.dag_id AND dag_run.{AUTOMATED_IN}
        ORDER BY logical_date DESC LIMIT 1
    ) AS r
    """
).bindparams(bindparam("dag_ids", type_=ARRAY(String)))


def latest_automated_intervals(
    session: Session, dag_ids: Collection[str]
) -> dict[str, DataInterval]:
    """The data interval of each DAG's latest scheduled or backfill run (DAGs without one are
    left out): manual runs never move a DAG's schedule, as in Airflow."""
    if not dag_ids:
        return {}
    rows = session.execute(_LATEST_AUTOMATED_SQL, {"dag_ids": sorted(dag_ids)})
    return {
        dag_id: DataInterval(start or logical_date, end or logical_date)
        for dag_id, logical_date, start, end in rows
    }


class Schedulable(Protocol):
    """What the next run needs of a DAG: a DAG object, or its parsed document (``StoredDag``:
    ``dags next-run`` imports no DAG file)."""

    @property
    def dag_id(self) -> str: ...
    def next_dagrun_info(
        self, last_automated_data_interval: DataInterval | None, *, now: dt.datetime
    ) -> DagRunInfo | None: ...


def next_run(session: Session, dag: Schedulable, now: dt.datetime) -> DagRunInfo | None:
    """The next run the scheduler will create for ``dag`` (None: it creates no more)."""
    latest = latest_automated_intervals(session, [dag.dag_id]).get(dag.dag_id)
    return dag.next_dagrun_info(latest, now=now)
