"""An example DAG: wait for the next event of the asset "orders" *or* six hours, whichever
comes first, and go on with what the event carries (or a default). Nothing runs while it waits:
the asset branch is a row that the transaction recording an "orders" event resolves (a task
with it as outlet succeeding, or a watcher), the time branch one timer the scheduler fires.
Run `example_assets` (its producer has "orders" in its outlets) to send it an event."""

from __future__ import annotations

import datetime as dt
from typing import Any

from deferral import DAG, BaseOperator, Context
from deferral.triggers import AnyOf, AssetEventTrigger, TimeDeltaTrigger


class WaitForOrdersOrTimeOut(BaseOperator):
    def execute(self, context: Context) -> None:
        self.defer(
            trigger=AnyOf(
                data=AssetEventTrigger("orders"),  # or an Asset
                timeout=TimeDeltaTrigger(dt.timedelta(hours=6)),
            ),
            method_name="execute_complete",
        )

    def execute_complete(self, context: Context, event: dict[str, Any]) -> Any:
        if event["fired"] == "timeout":
            return {"rows": 0, "timed_out": True}  # the default
        return {"event_id": event["payload"]["id"], **event["payload"]["extra"]}


with DAG("example_asset_wait", schedule=None, tags=["example"]):
    WaitForOrdersOrTimeOut(task_id="wait_for_orders")
