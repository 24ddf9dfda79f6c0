"""An example DAG: a trigger that reports progress before it fires. Each ``TriggerProgress``
is recorded for the waiting task (the task page's Progress panel, ``deferral tasks explain``);
only the ``TriggerEvent`` resumes it. Allow the trigger's module in the triggerer with
``DEFERRAL_TRIGGER_MODULES=deferral.triggers,example_progress``."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import anyio

from deferral import DAG, BaseOperator, Context
from deferral.triggers import BaseTrigger, TriggerEvent, TriggerProgress
from deferral.triggers.base import classpath_of


class CountdownTrigger(BaseTrigger):
    """Reports each of ``steps`` steps, one a second, then fires."""

    def __init__(self, steps: int = 5) -> None:
        super().__init__()
        self.steps = steps

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return classpath_of(CountdownTrigger), {"steps": self.steps}

    async def run(self) -> AsyncIterator[TriggerEvent | TriggerProgress]:
        for step in range(1, self.steps + 1):
            await anyio.sleep(1)
            yield TriggerProgress({"step": step, "of": self.steps})
        yield TriggerEvent({"done": True})


class WaitWithProgress(BaseOperator):
    def execute(self, context: Context) -> None:
        self.defer(trigger=CountdownTrigger(5), method_name="done")

    def done(self, context: Context, event: Any) -> Any:
        return event


with DAG("example_progress", schedule=None, tags=["example"]):
    WaitWithProgress(task_id="count_down")
