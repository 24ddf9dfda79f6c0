"""Branching: a branch follows one path and skips the other; a join after it runs with
``none_failed_min_one_success``. Short circuits skip what follows when their condition is
false: everything downstream by default, only the next tasks with
``ignore_downstream_trigger_rules=False``.
"""

from __future__ import annotations

import datetime as dt

from deferral import DAG, task
from deferral.operators import BranchPythonOperator, EmptyOperator, ShortCircuitOperator


def weekday_or_weekend(logical_date: dt.datetime) -> str:
    return "weekend_report" if logical_date.weekday() >= 5 else "weekday_report"


@task.branch
def by_size() -> list[str]:
    return ["small_batch"]


with DAG("example_branching", schedule=None) as dag:
    branch = BranchPythonOperator(task_id="which_day", python_callable=weekday_or_weekend)
    join = EmptyOperator(task_id="join", trigger_rule="none_failed_min_one_success")
    reports = [EmptyOperator(task_id="weekday_report"), EmptyOperator(task_id="weekend_report")]
    branch >> reports >> join

    join >> by_size() >> [EmptyOperator(task_id="small_batch"), EmptyOperator(task_id="big_batch")]

    nothing_new = ShortCircuitOperator(task_id="anything_new", python_callable=lambda: False)
    (
        nothing_new
        >> EmptyOperator(task_id="process")
        >> EmptyOperator(task_id="notify", trigger_rule="all_done")
    )  # skipped too: the default ignores downstream trigger rules

    only_next = ShortCircuitOperator(
        task_id="refresh_needed",
        python_callable=lambda: False,
        ignore_downstream_trigger_rules=False,
    )
    (
        only_next
        >> EmptyOperator(task_id="refresh")
        >> EmptyOperator(task_id="cleanup", trigger_rule="all_done")
    )  # runs: beyond the next tasks, trigger rules decide
