"""A custom XCom backend through the real worker (DEFERRAL_XCOM_BACKEND, the class in a module of
the DAGs folder): a TaskFlow task's return value is stored as the reference the backend's
serialize_value gives, and the next task receives the value its deserialize_value reads back."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from deferral.store.tables import TaskInstance, XCom
from tests.e2e.conftest import Services
from tests.helpers import wait_for

pytestmark = pytest.mark.e2e

BACKEND = """
import json
from pathlib import Path

from deferral.models.xcom import BaseXCom

STORE = Path({store!r})


class FileXComBackend(BaseXCom):
    @staticmethod
    def serialize_value(value, *, key=None, task_id=None, dag_id=None, run_id=None, map_index=None):
        path = STORE / f"{{task_id}}.{{key}}.json"
        path.write_text(json.dumps(value))
        return BaseXCom.serialize_value("file-store://" + path.name)

    @staticmethod
    def deserialize_value(result):
        name = BaseXCom.deserialize_value(result).removeprefix("file-store://")
        return json.loads((STORE / name).read_text())
"""

DAG = """
from deferral import dag, task


@dag(schedule=None)
def e2e_xcom_backend():
    @task
    def extract():
        return {"orders": [12, 7, 30]}

    @task
    def total(data):
        return sum(data["orders"])

    total(extract())


e2e_xcom_backend()
"""


def _finished(sessions: sessionmaker[Session]) -> dict[str, TaskInstance] | None:
    with sessions() as session:
        tis = session.scalars(select(TaskInstance)).all()
    if len(tis) == 2 and all(ti.state in ("success", "failed") for ti in tis):
        return {ti.task_id: ti for ti in tis}
    return None


def test_values_travel_through_the_backend(
    services: Services, write_dag: Any, sessions: sessionmaker[Session], tmp_path: Path
) -> None:
    store = tmp_path / "store"
    store.mkdir()
    write_dag("e2e_file_xcom_backend", BACKEND.format(store=str(store)))
    write_dag("e2e_xcom_backend_dag", DAG)
    backend = {"DEFERRAL_XCOM_BACKEND": "e2e_file_xcom_backend.FileXComBackend"}
    services.start("scheduler")
    services.start("worker", env=backend)
    assert services.run("dags", "trigger", "e2e_xcom_backend").returncode == 0

    tis = wait_for(lambda: _finished(sessions), timeout=120, what="both tasks to finish")
    assert {task_id: ti.state for task_id, ti in tis.items()} == {
        "extract": "success",
        "total": "success",
    }
    with sessions() as session:
        stored = dict(
            session.execute(
                select(TaskInstance.task_id, XCom.value).join(
                    TaskInstance, TaskInstance.id == XCom.task_instance_id
                )
            ).all()
        )
    assert stored == {
        "extract": "file-store://extract.return_value.json",
        "total": "file-store://total.return_value.json",
    }
    assert json.loads((store / "extract.return_value.json").read_text()) == {"orders": [12, 7, 30]}
    assert json.loads((store / "total.return_value.json").read_text()) == 49
