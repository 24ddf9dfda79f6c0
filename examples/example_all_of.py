"""An example DAG: go on only once both the legal and the finance approval signals came, in
any order. Each is a row; the task resumes with both payloads. Send them with

    deferral signals send legal-approved --payload '{"by": "ana"}'
    deferral signals send finance-approved --payload '{"by": "ben"}'
"""

from __future__ import annotations

from typing import Any

from deferral import DAG, BaseOperator, Context
from deferral.triggers import AllOf, SignalTrigger


class WaitForBothApprovals(BaseOperator):
    def execute(self, context: Context) -> None:
        self.defer(
            trigger=AllOf(
                legal=SignalTrigger("legal-approved"),
                finance=SignalTrigger("finance-approved"),
            ),
            method_name="execute_complete",
        )

    def execute_complete(self, context: Context, event: dict[str, Any]) -> Any:
        # {"fired": ["legal", "finance"], "payloads": {"legal": ..., "finance": ...}}
        return event["payloads"]


with DAG("example_all_of", schedule=None, tags=["example"]):
    WaitForBothApprovals(task_id="wait_for_approvals")
