"""An example DAG: start a long job elsewhere and wait for its callback, failing the task (or
retrying it) if the job stops saying it is alive. The job posts

    curl -X POST "$CALLBACK_URL/heartbeat"          # at least every five minutes
    curl -X POST "$CALLBACK_URL" -H 'content-type: application/json' \\
        -d '{"status": "success", "payload": {"rows": 1200}}'   # once, when done
"""

from __future__ import annotations

import datetime as dt
from typing import Any

from deferral import DAG, BaseOperator, Context
from deferral.triggers import CallbackTrigger


class RunLongJob(BaseOperator):
    def execute(self, context: Context) -> None:
        self.log.info("start the job with callback %s", context["callback"].url)
        self.defer(
            trigger=CallbackTrigger(heartbeat=dt.timedelta(minutes=5)),
            method_name="done",
        )

    def done(self, context: Context, event: Any) -> Any:
        return event


with DAG("example_callback_heartbeat", schedule=None, tags=["example"]):
    RunLongJob(task_id="long_job", retries=1)
