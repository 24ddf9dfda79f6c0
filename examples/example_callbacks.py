"""Callbacks: each gets the context, in the task's process for task callbacks; a callback that
raises is logged and changes nothing. ``flaky`` fails once (on_retry_callback), then succeeds.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

from deferral import DAG
from deferral.operators import PythonOperator


def announce(kind: str) -> Any:
    def callback(context: dict[str, Any]) -> None:
        error = context.get("exception")
        detail = f": {error!r}" if error else ""
        print(f"[{kind}] {context['ti'].task_id} try {context['try_number']}{detail}")

    return callback


def dag_finished(context: dict[str, Any]) -> None:
    print(f"run {context['run_id']} of {context['dag'].dag_id} ended: {context['reason']}")


def fails_on_first_try(try_number: int) -> str:
    if try_number == 1:
        raise RuntimeError("the upstream API timed out")
    return "ok on a retry"


with DAG(
    "example_callbacks",
    schedule=None,
    on_success_callback=dag_finished,
    on_failure_callback=dag_finished,
    default_args={
        "on_execute_callback": announce("execute"),
        "on_success_callback": announce("success"),
        "on_retry_callback": announce("retry"),
        "on_failure_callback": announce("failure"),
        "retry_delay": dt.timedelta(seconds=1),
    },
) as dag:
    PythonOperator(task_id="flaky", python_callable=fails_on_first_try, retries=1)
