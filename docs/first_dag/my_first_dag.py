"""Your first DAG: fetch a number, wait without holding a worker slot, then report."""

from __future__ import annotations

import datetime as dt

from deferral import BaseOperator, Context, dag, task
from deferral.triggers import TimeDeltaTrigger


class Pause(BaseOperator):
    """Hands its wait to the triggerer: no worker slot is held while it waits."""

    def execute(self, context: Context) -> None:
        wait = dt.timedelta(seconds=context["params"]["pause_seconds"])
        self.defer(trigger=TimeDeltaTrigger(wait), method_name="resume")

    def resume(self, context: Context, event: dt.datetime) -> str:
        return f"woke at {event:%H:%M:%S}"


@dag(schedule=None, params={"pause_seconds": 2})
def my_first_dag() -> None:
    @task
    def pick_a_number() -> int:
        return 21

    @task
    def report(number: int, woke: str) -> None:
        print(f"the answer is {number * 2}, {woke}")

    pause = Pause(task_id="pause")
    report(pick_a_number(), pause.output)


my_first_dag()
