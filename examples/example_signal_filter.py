"""An example DAG: every order's task waits on the one ``payments`` key, and resumes only on a
signal for its order that is paid and at least 100 (the filter is evaluated by PostgreSQL; other
signals on the key are recorded and resume nothing). Send one with

    deferral signals send payments --payload '{"order": "A-1", "status": "paid", "amount": 120}'
"""

from __future__ import annotations

from typing import Any

from deferral import DAG, BaseOperator, Context
from deferral.triggers import SignalTrigger


class WaitForPaidOrder(BaseOperator):
    def execute(self, context: Context) -> None:
        order = context["params"]["order"]
        self.defer(
            trigger=SignalTrigger(
                "payments",
                where={"order": order, "status": "paid", "amount": {">=": 100}},
            ),
            method_name="execute_complete",
        )

    def execute_complete(self, context: Context, event: Any) -> Any:
        return event


with DAG("example_signal_filter", schedule=None, params={"order": "A-1"}, tags=["example"]):
    WaitForPaidOrder(task_id="wait_for_paid_order")
