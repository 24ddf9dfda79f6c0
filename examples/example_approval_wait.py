"""An example DAG: ask a person to approve a release *or* wait a day, whichever comes first,
and go on (not fail) when nobody answers. The request is listed and answered as an
HITLOperator's is (`deferral approvals list`, then `deferral approvals respond <id> yes`, or
the web UI's Required actions) while the task is deferred; nothing runs while it waits."""

from __future__ import annotations

import datetime as dt
from typing import Any

from deferral import DAG, BaseOperator, Context
from deferral.triggers import AnyOf, ApprovalTrigger, TimeDeltaTrigger


class ApproveOrTimeOut(BaseOperator):
    def execute(self, context: Context) -> None:
        self.defer(
            trigger=AnyOf(
                approved=ApprovalTrigger("Ship release 1.2?", options=["yes", "no"]),
                timeout=TimeDeltaTrigger(dt.timedelta(days=1)),
            ),
            method_name="execute_complete",
        )

    def execute_complete(self, context: Context, event: dict[str, Any]) -> Any:
        if event["fired"] == "timeout":
            return {"ship": False, "reason": "nobody answered"}
        return {"ship": event["payload"]["chosen_options"] == ["yes"]}


with DAG("example_approval_wait", schedule=None, tags=["example"]):
    ApproveOrTimeOut(task_id="approve_release")
