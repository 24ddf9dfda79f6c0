"""An example DAG: wait for a payment signal *or* an hour, whichever comes first, and go on with
a default instead of failing when the hour passes. Nothing runs while it waits: the signal
branch is a row, the time branch one timer the scheduler fires. Send it with

    deferral signals send payment-received --payload '{"amount": 42}'
"""

from __future__ import annotations

import datetime as dt
from typing import Any

from deferral import DAG, BaseOperator, Context
from deferral.triggers import AnyOf, SignalTrigger, TimeDeltaTrigger


class WaitForPaymentOrTimeOut(BaseOperator):
    def execute(self, context: Context) -> None:
        self.defer(
            trigger=AnyOf(
                paid=SignalTrigger("payment-received"),
                timeout=TimeDeltaTrigger(dt.timedelta(hours=1)),
            ),
            method_name="execute_complete",
        )

    def execute_complete(self, context: Context, event: dict[str, Any]) -> Any:
        if event["fired"] == "timeout":
            return {"amount": 0, "timed_out": True}  # the default
        return event["payload"]


with DAG("example_any_of", schedule=None, tags=["example"]):
    WaitForPaymentOrTimeOut(task_id="wait_for_payment")
