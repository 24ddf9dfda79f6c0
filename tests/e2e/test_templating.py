"""Templating, Variables and Connections through the real services: template fields render in
the worker before execute and again before a resume; Variables and Connections from the table
and from the environment reach task code and templates; an undefined name fails its task naming
it; what rendered is recorded with secrets masked; no command prints a password."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select, text
from sqlalchemy.orm import Session, sessionmaker

from deferral.store.tables import DagRun, TaskInstance, TaskStateChange
from deferral.store.xcom import DatabaseXComs
from tests.e2e.conftest import Services
from tests.helpers import wait_for

pytestmark = pytest.mark.e2e

DAG_ID = "e2e_templating"
TABLE_PASSWORD = "table-pass-8841"
ENV_PASSWORD = "env-pass-5512"

DAG = """
import datetime as dt

from deferral import DAG, BaseOperator, Variable
from deferral.hooks.base import BaseHook
from deferral.operators import PythonOperator
from deferral.sensors import FileSensor
from deferral.triggers import TimeDeltaTrigger


class Echo(BaseOperator):
    template_fields = ("message", "settings")

    def __init__(self, *, message, settings=None, **kwargs):
        super().__init__(**kwargs)
        self.message = message
        self.settings = settings

    def execute(self, context):
        return {"message": self.message, "settings": self.settings}


class RendersThenDefers(BaseOperator):
    template_fields = ("target",)

    def __init__(self, *, target, **kwargs):
        super().__init__(**kwargs)
        self.target = target

    def execute(self, context):
        self.defer(
            trigger=TimeDeltaTrigger(dt.timedelta(seconds=1)),
            method_name="done",
            kwargs={"before": self.target},
        )

    def done(self, context, event, before):
        return {"before": before, "after": self.target}


def report(day, x, *, table_var, env_var, table_host, env_host, pw, templates_dict):
    return {
        "day": day,
        "x": x,
        "table_var": table_var,
        "env_var": env_var,
        "table_host": table_host,
        "env_host": env_host,
        "pw_ok": pw == "table-pass-8841",
        "pulled": templates_dict["pulled"],
    }


def in_code():
    return {
        "table_var": Variable.get("table_var"),
        "env_var": Variable.get("env_var"),
        "table_json": Variable.get("table_json", deserialize_json=True),
        "missing": Variable.get("missing", default_var="fallback"),
        "table_pw": BaseHook.get_connection("table_conn").password,
        "env_pw": BaseHook.get_connection("env_conn").password,
        "env_extra": BaseHook.get_connection("env_conn").extra_dejson,
    }


with DAG("e2e_templating", params={"x": "dag-default", "dir": "{folder}"}) as dag:
    echo = Echo(
        task_id="echo",
        message="echo {{ ds }} {{ params.x }}",
        settings={"run": "{{ run_id }}", "nested": ["{{ var.json.table_json.k }}"]},
    )
    python = PythonOperator(
        task_id="python",
        python_callable=report,
        op_args=["{{ ds }}", "{{ params.x }}"],
        op_kwargs={
            "table_var": "{{ var.value.table_var }}",
            "env_var": "{{ var.value.env_var }}",
            "table_host": "{{ conn.table_conn.host }}",
            "env_host": "{{ conn.env_conn.host }}",
            "pw": "{{ conn.table_conn.password }}",
        },
        templates_dict={"pulled": "{{ ti.xcom_pull(task_ids='echo')['message'] }}"},
    )
    echo >> python
    PythonOperator(task_id="in_code", python_callable=in_code)
    FileSensor(task_id="sensor", filepath="{{ params.dir }}/{{ ds_nodash }}.done", poke_interval=1)
    RendersThenDefers(task_id="defers", target="{{ params.x }}@{{ ti.try_number }}")
    Echo(task_id="undefined", message="echo {{ nope }}")
"""


def _states(sessions: sessionmaker[Session]) -> dict[str, str]:
    with sessions() as session:
        rows = session.execute(select(TaskInstance.task_id, TaskInstance.state)).all()
    return dict(tuple(row) for row in rows)  # type: ignore[arg-type]


def _reason(sessions: sessionmaker[Session], task_id: str) -> str:
    with sessions() as session:
        reason = session.scalars(
            select(TaskStateChange.reason)
            .join(TaskInstance, TaskInstance.id == TaskStateChange.task_instance_id)
            .where(TaskInstance.task_id == task_id)
            .order_by(TaskStateChange.id.desc())
        ).first()
    return reason or ""


def test_templates_variables_and_connections_through_the_services(
    services: Services,
    write_dag: Any,
    sessions: sessionmaker[Session],
    tmp_path: Path,
) -> None:
    folder = tmp_path / "flags"
    folder.mkdir()
    write_dag("e2e_templating_dag", DAG.replace("{folder}", str(folder)))
    # From the table, through the commands.
    for args in (
        ("variables", "set", "table_var", "from-table"),
        ("variables", "set", "table_json", '{"k": "json-k"}', "--json"),
        (
            "connections",
            "add",
            "table_conn",
            "--conn-uri",
            f"postgres://etl:{TABLE_PASSWORD}@table-host:5432/dw",
        ),
    ):
        result = services.run(*args)
        assert result.returncode == 0, result.stderr
    # From the environment of the services.
    services.env["DEFERRAL_VAR_ENV_VAR"] = "from-env"
    services.env["DEFERRAL_CONN_ENV_CONN"] = json.dumps(
        {"conn_type": "http", "host": "env-host", "password": ENV_PASSWORD, "extra": {"a": 1}}
    )
    services.start("scheduler")
    services.start("worker", "--concurrency", "2")
    services.start("triggerer")
    trigger = services.run("dags", "trigger", DAG_ID, "--run-id", "r1", "--conf", '{"x": "cx"}')
    assert trigger.returncode == 0, trigger.stderr
    with sessions() as session:
        ds = session.scalars(select(DagRun.logical_date)).one().strftime("%Y-%m-%d")
    (folder / f"{ds.replace('-', '')}.done").write_text("")

    finished = {"success", "failed", "skipped", "upstream_failed"}
    states = wait_for(
        lambda: (s := _states(sessions)) and len(s) == 6 and set(s.values()) <= finished and s,
        timeout=120,
        what="every task to finish",
    )
    assert states == {
        "echo": "success",
        "python": "success",
        "in_code": "success",
        "sensor": "success",
        "defers": "success",
        "undefined": "failed",
    }
    xcoms = DatabaseXComs(sessions)

    def value(task_id: str) -> Any:
        return xcoms.pull(DAG_ID, "r1", task_id, "return_value", -1)

    assert value("echo") == {
        "message": f"echo {ds} cx",
        "settings": {"run": "r1", "nested": ["json-k"]},
    }
    assert value("python") == {
        "day": ds,
        "x": "cx",
        "table_var": "from-table",
        "env_var": "from-env",
        "table_host": "table-host",
        "env_host": "env-host",
        "pw_ok": True,
        "pulled": f"echo {ds} cx",
    }
    assert value("in_code") == {
        "table_var": "from-table",
        "env_var": "from-env",
        "table_json": {"k": "json-k"},
        "missing": "fallback",
        "table_pw": TABLE_PASSWORD,
        "env_pw": ENV_PASSWORD,
        "env_extra": {"a": 1},
    }
    # Rendered on the first attempt and again, on a fresh copy, before the resume method.
    assert value("defers") == {"before": "cx@1", "after": "cx@1"}
    assert "template field 'message' of task 'undefined': 'nope' is undefined" in _reason(
        sessions, "undefined"
    )

    # What rendered is recorded, the password masked; the commands never print it.
    render = services.run("tasks", "render", DAG_ID, "r1", "python")
    assert render.returncode == 0, render.stderr
    assert render.stdout.splitlines()[0].startswith(f"# {DAG_ID}.r1.python try 1, rendered ")
    assert '"pw": "***"' in render.stdout and f'"{ds}"' in render.stdout
    with sessions() as session:
        recorded = session.execute(
            text(
                "SELECT r.rendered FROM rendered_task_instance_fields r"
                " JOIN task_instance t ON t.id = r.task_instance_id WHERE t.task_id = 'python'"
            )
        ).scalar_one()
        stored_password = session.execute(text("SELECT password FROM connection")).scalar_one()
    assert recorded["op_kwargs"]["pw"] == "***"
    assert TABLE_PASSWORD not in json.dumps(recorded)
    assert TABLE_PASSWORD not in stored_password  # ciphertext in Postgres
    for conn_id in ("table_conn", "env_conn"):
        shown = services.run("connections", "get", conn_id)
        assert shown.returncode == 0, shown.stderr
        assert TABLE_PASSWORD not in shown.stdout and ENV_PASSWORD not in shown.stdout
        assert "***" in shown.stdout
    for name in services.procs:
        assert TABLE_PASSWORD not in services.log(name)
