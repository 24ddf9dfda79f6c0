"""``deferral xcom list|get``: the values tasks pushed, as JSON, with every known secret masked
(as in the web UI: :func:`deferral.store.stored_secrets.shown_xcom`)."""

from __future__ import annotations

import json
from typing import Any

import click
from sqlalchemy import select

from broker.streams import task_label
from deferral.runtime.crypto import Cipher
from deferral.runtime.process import command_group, settings_or_exit
from deferral.store.stored_secrets import known_secrets, shown_xcom
from deferral.store.tables import TaskInstance, XCom
from deferral_cli.common import (
    Record,
    emit,
    fail,
    find_run,
    output_options,
    run_id_argument,
    sessions,
)

# The key a task's return value is pushed under, as in Airflow.
RETURN_VALUE = "return_value"
# A table cell shows at most this much of a value; --output json shows it whole.
MAX_CELL_CHARS = 60


@command_group()
def xcom() -> None:
    """XComs: values tasks pushed (their return value under the key return_value)."""


@xcom.command("list")
@click.argument("dag_id")
@run_id_argument
@click.argument("task_id", required=False)
@output_options
def xcom_list(dag_id: str, run_id: str, task_id: str | None, output: str) -> None:
    """List the XComs of a run (of TASK_ID, if given): task, map index, key, value (as JSON)."""
    settings = settings_or_exit()
    query = (
        select(TaskInstance.task_id, TaskInstance.map_index, XCom.key, XCom.value, XCom.created_at)
        .join(TaskInstance, TaskInstance.id == XCom.task_instance_id)
        .where(TaskInstance.dag_id == dag_id, TaskInstance.run_id == run_id)
        .order_by(TaskInstance.id, XCom.key)
    )
    if task_id is not None:
        query = query.where(TaskInstance.task_id == task_id)
    with sessions(settings)() as session:
        if find_run(session, dag_id, run_id) is None:
            fail(f"DAG {dag_id!r} has no run {run_id!r}")
        rows = session.execute(query).all()
        masker = known_secrets(session, Cipher(settings.fernet_keys))
    records: list[Record] = [
        {
            "task_id": row.task_id,
            "map_index": row.map_index,
            "key": row.key,
            "value": shown_xcom(masker, row.key, row.value),
            "created_at": row.created_at,
        }
        for row in rows
    ]
    emit(output, records, empty="no XComs", cells={"value": _value_cell})


@xcom.command("get")
@click.argument("dag_id")
@run_id_argument
@click.argument("task_id")
@click.option("--key", default=RETURN_VALUE, show_default=True, help="The XCom's key.")
@click.option("--map-index", type=int, default=-1, show_default=True, help="A mapped task's index.")
def xcom_get(dag_id: str, run_id: str, task_id: str, key: str, map_index: int) -> None:
    """Print the value TASK_ID pushed under --key in a run, as JSON."""
    settings = settings_or_exit()
    label = task_label(dag_id, run_id, task_id, map_index)
    with sessions(settings)() as session:
        if find_run(session, dag_id, run_id) is None:
            fail(f"DAG {dag_id!r} has no run {run_id!r}")
        ti_id = session.scalar(
            select(TaskInstance.id).where(
                TaskInstance.dag_id == dag_id,
                TaskInstance.run_id == run_id,
                TaskInstance.task_id == task_id,
                TaskInstance.map_index == map_index,
            )
        )
        if ti_id is None:
            fail(f"run {run_id!r} of DAG {dag_id!r} has no task instance {label}")
        row = session.execute(
            select(XCom.value).where(XCom.task_instance_id == ti_id, XCom.key == key)
        ).one_or_none()
        masker = known_secrets(session, Cipher(settings.fernet_keys))
    if row is None:
        fail(f"{label} has no XCom {key!r}")
        return
    click.echo(json.dumps(shown_xcom(masker, key, row.value), indent=2))


def _value_cell(value: Any) -> str:
    text = json.dumps(value, separators=(",", ":"))
    return text if len(text) <= MAX_CELL_CHARS else text[: MAX_CELL_CHARS - 3] + "..."
