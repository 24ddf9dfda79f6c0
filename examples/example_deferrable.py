"""An example DAG: a custom deferrable operator frees its worker slot while it waits, then a
downstream task uses what it returned. The wait is the param ``wait_seconds`` (3 by default;
trigger with conf ``{"wait_seconds": 30}`` to watch it wait in the web UI)."""

from __future__ import annotations

import datetime as dt
from typing import Any

from deferral import DAG, BaseOperator, Context
from deferral.operators import PythonOperator
from deferral.triggers import TimeDeltaTrigger


class WaitThenCount(BaseOperator):
    """Waits ``seconds`` without holding a worker slot, then reports how long it really waited."""

    def __init__(self, *, seconds: float, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.seconds = seconds

    def execute(self, context: Context) -> None:
        started = dt.datetime.now(dt.UTC)
        seconds = float(context["params"].get("wait_seconds", self.seconds))
        self.defer(
            trigger=TimeDeltaTrigger(dt.timedelta(seconds=seconds)),
            method_name="resume",
            kwargs={"started": started},
            timeout=dt.timedelta(minutes=5),
        )

    def resume(self, context: Context, event: dt.datetime, started: dt.datetime) -> dict[str, Any]:
        waited = (dt.datetime.now(dt.UTC) - started).total_seconds()
        print(f"trigger fired at {event.isoformat()}, waited {waited:.1f}s")
        return {"waited_seconds": round(waited, 1), "fired_at": event.isoformat()}


def report(ti: Any) -> str:
    result = ti.xcom_pull(task_ids="wait")
    message = f"the wait took {result['waited_seconds']}s"
    print(message)
    return message


with DAG("example_deferrable", schedule=None, params={"wait_seconds": 3}) as dag:
    wait = WaitThenCount(task_id="wait", seconds=3)
    done = PythonOperator(task_id="report", python_callable=report)
    wait >> done
