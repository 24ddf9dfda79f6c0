"""An example DAG: wait a day for the shipment date, unless the order is cancelled first: a
signal on ``orders`` whose payload says so ends the task ``skipped`` (``cancel_state="failed"``
would fail it) and downstream tasks follow their trigger rules. Cancel it with

    deferral signals send orders --payload '{"order": "A-1", "cancelled": true}'
"""

from __future__ import annotations

import datetime as dt
from typing import Any

from deferral import DAG, BaseOperator, Context
from deferral.operators import EmptyOperator
from deferral.triggers import SignalTrigger, TimeDeltaTrigger


class WaitUnlessCancelled(BaseOperator):
    def execute(self, context: Context) -> None:
        self.defer(
            trigger=TimeDeltaTrigger(dt.timedelta(days=1)),
            method_name="execute_complete",
            cancel_on=SignalTrigger("orders", where={"order": "A-1", "cancelled": True}),
        )

    def execute_complete(self, context: Context, event: Any) -> str:
        return "ship it"


with DAG("example_cancel_on", schedule=None, tags=["example"]):
    WaitUnlessCancelled(task_id="wait_for_shipment_date") >> EmptyOperator(task_id="ship")
