"""An example DAG: Variables and Connections in task code (``Variable.get``, a ``BaseHook``) and
in templates (``{{ var.value.X }}``, ``{{ conn.X.host }}``).

Give it a connection and a variable first, in the table (encrypted with DEFERRAL_FERNET_KEY)::

    deferral connections add example_api --conn-uri 'https://bot:s3cret@api.example.com:443/v1?timeout=5'
    deferral variables set example_settings '{"batch_size": 50}' --json

or in the environment of the worker, which wins over the table::

    export DEFERRAL_CONN_EXAMPLE_API='https://bot:s3cret@api.example.com:443/v1?timeout=5'
    export DEFERRAL_VAR_EXAMPLE_SETTINGS='{"batch_size": 50}'

``deferral connections get example_api`` shows it with the password masked.
"""

from __future__ import annotations

from typing import Any

from deferral import DAG, Variable
from deferral.hooks.base import BaseHook
from deferral.operators import PythonOperator


class ExampleApiHook(BaseHook):
    """A user hook: reads where and how to reach the API from a connection."""

    conn_name_attr = "api_conn_id"
    default_conn_name = "example_api"
    conn_type = "https"
    hook_name = "Example API"

    def __init__(self, api_conn_id: str = default_conn_name) -> None:
        super().__init__()
        self.api_conn_id = api_conn_id

    def get_conn(self) -> dict[str, Any]:
        conn = self.get_connection(self.api_conn_id)
        # A real hook would build a client here; the password stays out of logs and XComs.
        return {
            "base_url": f"{conn.conn_type}://{conn.host}:{conn.port}/{conn.schema or ''}",
            "user": conn.login,
            "has_password": bool(conn.password),
            "timeout": conn.extra_dejson.get("timeout"),
        }


def describe_api() -> dict[str, Any]:
    settings = Variable.get("example_settings", default_var={}, deserialize_json=True)
    return {"client": ExampleApiHook().get_conn(), "batch_size": settings.get("batch_size", 10)}


with DAG("example_variables_connections", schedule=None) as dag:
    PythonOperator(task_id="describe_api", python_callable=describe_api) >> PythonOperator(
        task_id="templated",
        python_callable=print,
        op_args=[
            "api host {{ conn.example_api.host }}, batch size "
            "{{ var.json.get('example_settings', {}).get('batch_size', 10) }}"
        ],
    )
