"""An example DAG: Jinja templates in operator fields, rendered by the worker before each
attempt, with Airflow's context (``ds``, ``params``, ``var``, ``conn``, ``macros``, ``ti``).

See what a task's fields rendered to: ``deferral tasks render example_templating RUN_ID greet``.
"""

from __future__ import annotations

from typing import Any

from deferral import DAG, BaseOperator, Context
from deferral.operators import PythonOperator
from deferral.sensors import FileSensor


class Announce(BaseOperator):
    """A user operator: every attribute named in ``template_fields`` is a template."""

    template_fields = ("message", "labels")

    def __init__(self, *, message: str, labels: dict[str, Any] | None = None, **kwargs: Any):
        super().__init__(**kwargs)
        self.message = message
        self.labels = labels or {}

    def execute(self, context: Context) -> dict[str, Any]:
        print(self.message, self.labels)
        return {"message": self.message, "labels": self.labels}


def greet(day: str, who: str, *, week_later: str, templates_dict: dict[str, Any]) -> str:
    line = f"{day}: hello {who}; a week later is {week_later}; {templates_dict['upstream']}"
    print(line)
    return line


with DAG(
    "example_templating",
    schedule=None,
    params={"who": "world", "inbox": "/tmp/deferral-example-inbox"},
    user_defined_macros={"team": "data-platform"},
) as dag:
    announce = Announce(
        task_id="announce",
        message="run {{ run_id }} for {{ ds }} by {{ team }}",
        labels={
            "interval": ["{{ data_interval_start | ds }}", "{{ data_interval_end | ds }}"],
            # A Variable with a fallback, so the example runs without setting it.
            "region": "{{ var.value.get('example_region', 'eu-west-1') }}",
        },
    )
    greet_task = PythonOperator(
        task_id="greet",
        python_callable=greet,
        op_args=["{{ ds }}", "{{ params.who }}"],  # deferral dags trigger --conf '{"who": "x"}'
        op_kwargs={"week_later": "{{ macros.ds_add(ds, 7) }}"},
        templates_dict={"upstream": "{{ ti.xcom_pull(task_ids='announce')['message'] }}"},
    )
    # Sensor targets are templates too: waits (freeing its slot) for today's flag file.
    flag = FileSensor(
        task_id="wait_for_flag",
        filepath="{{ params.inbox }}/{{ ds_nodash }}.done",
        mode="reschedule",
        poke_interval=10,
        timeout=60,
        soft_fail=True,
    )
    announce >> greet_task >> flag
