"""An example scheduled DAG, as an Airflow 2 user writes one: a cron schedule, a naive start
date (read in DEFERRAL_DEFAULT_TIMEZONE), data intervals, max_active_runs and dagrun_timeout.

Paused upon creation so that `deferral standalone --dags-folder examples` does not start it:
`deferral dags unpause example_schedule` starts the schedule (catchup=False: the latest
interval first), `deferral dags backfill example_schedule -s 2024-01-01 -e 2024-01-03` runs
three past days, `deferral dags next-run example_schedule` shows what comes next.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

from deferral import DAG
from deferral.operators import PythonOperator


def summarize(dag_run: Any) -> str:
    # A scheduled run covers its data interval: the day before the run, for @daily.
    start, end = dag_run.data_interval_start, dag_run.data_interval_end
    message = f"{dag_run.run_type} run {dag_run.run_id} covers {start} to {end}"
    print(message)
    return message


with DAG(
    "example_schedule",
    schedule="0 6 * * *",  # every day at 06:00 in the start date's zone
    start_date=dt.datetime(2024, 1, 1),
    catchup=False,
    max_active_runs=2,
    dagrun_timeout=dt.timedelta(hours=1),
    is_paused_upon_creation=True,
) as dag:
    PythonOperator(task_id="summarize", python_callable=summarize)
