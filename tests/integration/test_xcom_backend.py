"""A custom XCom backend (DEFERRAL_XCOM_BACKEND, Airflow's BaseXCom seam) against PostgreSQL:
what ``serialize_value`` returns is what is stored (here a reference to a file the backend
wrote, as an object-store backend would), and task code pulls what ``deserialize_value`` makes of
it; a bad setting fails with one line naming it."""

from __future__ import annotations

import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from deferral.models.xcom import BaseXCom, StoredXCom, resolve_xcom_backend
from deferral.runtime.config import ConfigError
from deferral.store.tables import XCom
from deferral.store.xcom import DatabaseXComs
from tests.integration.factories import DAG_ID, running_task

BACKEND = """
import json
from pathlib import Path

from deferral.models.xcom import BaseXCom

STORE = Path({store!r})
PREFIX = "file-store://"


class FileXComBackend(BaseXCom):
    @staticmethod
    def serialize_value(value, *, key=None, task_id=None, dag_id=None, run_id=None, map_index=None):
        path = STORE / f"{{dag_id}}.{{run_id}}.{{task_id}}.{{map_index}}.{{key}}.json"
        path.write_text(json.dumps(value))
        return BaseXCom.serialize_value(PREFIX + path.name)

    @staticmethod
    def deserialize_value(result):
        reference = BaseXCom.deserialize_value(result)
        return json.loads((STORE / reference.removeprefix(PREFIX)).read_text())


class NotABackend:
    pass
"""


@pytest.fixture
def backend_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    name = f"xcom_backend_{uuid.uuid4().hex[:8]}"
    store = tmp_path / "store"
    store.mkdir()
    (tmp_path / f"{name}.py").write_text(BACKEND.format(store=str(store)))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name
    sys.modules.pop(name, None)


def test_values_go_through_the_backend_both_ways(
    sessions: sessionmaker[Session], backend_module: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DEFERRAL_XCOM_BACKEND", f"{backend_module}.FileXComBackend")
    backend = resolve_xcom_backend()
    assert backend.__name__ == "FileXComBackend" and issubclass(backend, BaseXCom)
    ti_id = running_task(sessions, task_id="produce", run_id="r1")
    xcoms = DatabaseXComs(sessions, backend)
    value: dict[str, Any] = {"rows": list(range(5)), "name": "orders"}
    xcoms.push(ti_id, "big", value)

    with sessions() as session:
        stored = session.scalars(select(XCom.value).where(XCom.task_instance_id == ti_id)).one()
    assert stored == f"file-store://{DAG_ID}.r1.produce.-1.big.json"
    assert xcoms.pull(DAG_ID, "r1", "produce", "big", None) == value
    assert xcoms.pull(DAG_ID, "r1", "produce", "big", -1) == value
    # Without the backend, task code would see the reference.
    assert DatabaseXComs(sessions).pull(DAG_ID, "r1", "produce", "big", None) == stored


def test_the_default_stores_values_as_they_are(sessions: sessionmaker[Session]) -> None:
    ti_id = running_task(sessions, task_id="t", run_id="r1")
    xcoms = DatabaseXComs(sessions, resolve_xcom_backend())
    xcoms.push(ti_id, "k", {"a": [1, 2]})
    with sessions() as session:
        stored = session.scalars(select(XCom.value).where(XCom.task_instance_id == ti_id)).one()
    assert stored == {"a": [1, 2]}
    assert BaseXCom.deserialize_value(StoredXCom("k", 5, DAG_ID, "r1", "t", -1)) == 5


@pytest.mark.parametrize(
    ("setting", "message"),
    [
        ("no_such_module_xyz.Backend", "cannot be imported: ModuleNotFoundError"),
        ("{module}.Missing", "cannot be imported: AttributeError"),
        ("{module}.NotABackend", "not a subclass of deferral.models.xcom.BaseXCom"),
        ("Backend", "is not a module.Class path"),
    ],
)
def test_a_bad_setting_fails_naming_it(
    backend_module: str, monkeypatch: pytest.MonkeyPatch, setting: str, message: str
) -> None:
    monkeypatch.setenv("DEFERRAL_XCOM_BACKEND", setting.format(module=backend_module))
    with pytest.raises(ConfigError, match="DEFERRAL_XCOM_BACKEND") as refused:
        resolve_xcom_backend()
    assert message in str(refused.value)
    assert "\n" not in str(refused.value)
