"""Task groups: ids carry the group's id (``extract.orders``), a group's default_args apply to
its tasks, and ``group >> group`` wires the first group's leaves to the second's roots."""

from __future__ import annotations

import datetime as dt

from deferral import DAG, TaskGroup, task, task_group
from deferral.operators import EmptyOperator


@task
def fetch(table: str) -> int:
    return len(table)


@task
def check(rows: int) -> bool:
    return rows > 0


@task_group
def validate(rows: int) -> None:
    """Checks one table's rows (a group per call: validate, validate__1, ...)."""
    check(rows) >> EmptyOperator(task_id="publish")


with DAG("example_task_groups", schedule=None) as dag:
    start = EmptyOperator(task_id="start")
    with TaskGroup("extract", default_args={"retries": 2}) as extract:
        orders = fetch.override(task_id="orders")("orders")
        customers = fetch.override(task_id="customers")("customers")
    with TaskGroup("load", default_args={"retry_delay": dt.timedelta(seconds=5)}) as load:
        EmptyOperator(task_id="warehouse") >> EmptyOperator(task_id="refresh_views")
    start >> extract >> load
    load >> validate(orders)
    load >> validate(customers)
