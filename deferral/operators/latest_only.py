"""LatestOnlyOperator: lets what follows run only for the latest run of the schedule."""

from __future__ import annotations

import datetime as dt
import logging

from deferral.context import Context, DagRunInfo
from deferral.dag import DAG
from deferral.operators.branch import BaseBranchOperator
from deferral.timetables import DataInterval

log = logging.getLogger(__name__)


def is_latest_run(dag: DAG, dag_run: DagRunInfo, now: dt.datetime) -> bool:
    """Whether ``dag_run`` is the latest run of its schedule at ``now`` (Airflow's latest_only):
    the interval of the run after it holds ``now``. A manual run, and the last run a schedule
    has, always are."""
    if dag_run.external_trigger:
        return True
    if dag_run.data_interval_start is None or dag_run.data_interval_end is None:
        return True  # a run recorded without its interval: nothing to compare with
    interval = DataInterval(dag_run.data_interval_start, dag_run.data_interval_end)
    following = dag.next_dagrun_info(interval, now=now, restricted=False)
    if following is None:
        return True
    window = following.data_interval
    log.info(
        "latest only: run %s is the latest if %s < now (%s) <= %s",
        dag_run.run_id,
        window.start.isoformat(),
        now.isoformat(),
        window.end.isoformat(),
    )
    return window.start < now <= window.end


class LatestOnlyOperator(BaseBranchOperator):
    """Skips its directly-downstream tasks unless the run is the latest of the schedule (see
    ``is_latest_run``); trigger rules carry the skip further down. Manual runs never skip."""

    def choose_branch(self, context: Context) -> list[str]:
        """The downstream tasks to run: all of them, or none."""
        latest = is_latest_run(context["dag"], context["dag_run"], dt.datetime.now(dt.UTC))
        return sorted(self.downstream_task_ids) if latest else []
