"""An example DAG: a task waits for a signal (a payment provider's webhook, say) without
holding a worker slot or a trigger, then a downstream task uses its payload. Send it with

    deferral signals send payment-received --payload '{"amount": 42}'

(or ``POST /api/v1/signals/payment-received`` with ``{"payload": {...}}``, or
``deferral.signals.send("payment-received", {...})`` from code). A signal sent up to ten
minutes before the task started waiting also counts (``lookback``)."""

from __future__ import annotations

import datetime as dt
from typing import Any

from deferral import DAG, BaseOperator, Context
from deferral.operators import PythonOperator


class WaitForPayment(BaseOperator):
    """Resumes with the payload of the next signal on ``payment-received``."""

    def execute(self, context: Context) -> None:
        self.wait_for_signal(
            "payment-received",
            lookback=dt.timedelta(minutes=10),
            timeout=dt.timedelta(hours=1),
        )

    def execute_complete(self, context: Context, event: Any) -> Any:
        return event


def ship(amount: Any) -> str:
    return f"shipping an order paid {amount}"


with DAG("example_signals", schedule=None, tags=["example"]):
    WaitForPayment(task_id="wait_for_payment") >> PythonOperator(
        task_id="ship",
        python_callable=ship,
        op_kwargs={"amount": "{{ ti.xcom_pull(task_ids='wait_for_payment')['amount'] }}"},
    )
