"""TaskFlow: functions become tasks, their return values flow to the tasks that take them.

``extract`` returns a dict with ``multiple_outputs``, so each key is its own XCom; a classic
PythonOperator takes an XComArg in ``op_kwargs``; ``threshold`` is a DAG param (trigger with
``--conf '{"threshold": 5}'`` to change it); a ``@task.sensor`` waits for a condition.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

from deferral import dag, task
from deferral.operators import PythonOperator
from deferral.sensors import PokeReturnValue


@task.sensor(poke_interval=1, timeout=60, mode="reschedule")
def source_ready() -> PokeReturnValue:
    """Ready once the clock's second is even (a stand-in for "the export landed")."""
    now = dt.datetime.now(dt.UTC)
    return PokeReturnValue(is_done=now.second % 2 == 0, xcom_value=now.isoformat())


@task(multiple_outputs=True)
def extract(ready_at: str) -> dict[str, Any]:
    return {"orders": [12, 7, 30], "currency": "EUR", "ready_at": ready_at}


@task
def total(orders: list[int]) -> int:
    return sum(orders)


@task
def report(amount: int, currency: str, threshold: int) -> str:
    flag = "above" if amount > threshold else "within"
    message = f"{amount} {currency}, {flag} the threshold of {threshold}"
    print(message)
    return message


def audit(amount: int) -> None:
    print(f"audited {amount}")


@dag(schedule=None)
def example_taskflow(threshold: int = 40) -> None:
    """Orders of the day: extract, sum, report."""
    data = extract(source_ready())
    amount = total(data["orders"])
    report(amount, data["currency"], threshold)
    PythonOperator(task_id="audit", python_callable=audit, op_kwargs={"amount": amount})


example_taskflow()
