"""An example DAG: tasks that start and end in the triggerer, and tasks that share one trigger.

- ``at_moment`` starts in the triggerer (``start_from_trigger``): the scheduler defers it to a
  ``DateTimeTrigger`` as soon as it is scheduled, no worker slot taken; the trigger fires and a
  worker runs ``execute_complete`` with the event.
- ``ends_at_moment`` also ends there: its trigger yields ``TaskSuccessEvent`` (Airflow 2.10's
  ``end_from_trigger``), and no worker ever runs it.
- the 20 ``wait_<n>`` tasks defer on the same moment: ``DateTimeTrigger`` is shared, so they
  wait on one trigger, whose event resumes all of them.

The moment is a fixed one in the past (so a run goes straight through); use a later one to watch
the tasks wait in the web UI, holding no worker slot and, for the 20, one trigger."""

from __future__ import annotations

import datetime as dt
from typing import Any

from deferral import DAG, BaseOperator, Context
from deferral.triggers import DateTimeTrigger, StartTriggerArgs

MOMENT = dt.datetime(2024, 1, 1, 6, 0, tzinfo=dt.UTC)


class WaitUntil(BaseOperator):
    """Waits for ``moment`` without a worker; with ``end_from_trigger`` it also succeeds there."""

    start_from_trigger = True

    def __init__(self, *, moment: dt.datetime, end_from_trigger: bool = False, **kwargs: Any):
        super().__init__(**kwargs)
        self.start_trigger_args = StartTriggerArgs(
            trigger_cls="deferral.triggers.temporal.DateTimeTrigger",
            next_method="execute_complete",
            trigger_kwargs={"moment": moment, "end_from_trigger": end_from_trigger},
            timeout=dt.timedelta(days=1),
        )

    def execute(self, context: Context) -> None:
        # Not reached: a try of a start_from_trigger task defers before execute() runs.
        raise NotImplementedError

    def execute_complete(self, context: Context, event: dt.datetime) -> str:
        return f"the moment {event.isoformat()} came"


class WaitForSharedMoment(BaseOperator):
    """Defers on ``DateTimeTrigger(moment)``: equal ones share one trigger."""

    def __init__(self, *, index: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.index = index

    def execute(self, context: Context) -> None:
        self.defer(trigger=DateTimeTrigger(MOMENT), method_name="resume")

    def resume(self, context: Context, event: dt.datetime) -> int:
        return self.index


with DAG("example_triggerer_tasks", schedule=None, tags=["example"]) as dag:
    WaitUntil(task_id="at_moment", moment=MOMENT)
    WaitUntil(task_id="ends_at_moment", moment=MOMENT, end_from_trigger=True)
    for index in range(20):
        WaitForSharedMoment(task_id=f"wait_{index}", index=index)
