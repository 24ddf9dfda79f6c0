"""LatestOnlyOperator: the report is sent for the latest scheduled run only. Caught-up and
backfilled runs skip it (and everything after it, by the trigger rules); manual runs never do.

Paused upon creation: `deferral dags unpause example_latest_only`, or try
`deferral dags backfill example_latest_only -s 2024-01-01 -e 2024-01-02`: both runs skip.
"""

from __future__ import annotations

import datetime as dt

from deferral import DAG
from deferral.operators import EmptyOperator, LatestOnlyOperator, PythonOperator

with DAG(
    "example_latest_only",
    schedule=dt.timedelta(hours=4),
    start_date=dt.datetime(2024, 1, 1),
    catchup=False,
    is_paused_upon_creation=True,
) as dag:
    load = EmptyOperator(task_id="load")
    latest_only = LatestOnlyOperator(task_id="latest_only")
    report = PythonOperator(task_id="send_report", python_callable=print, op_args=["report sent"])
    load >> latest_only >> report
