"""The DAG store (readmodel/DECISIONS.md 5): the schedulers write each parsed DAG's document,
and the web UI and the display commands read only that, never a DAG file."""

from __future__ import annotations

import base64
import dataclasses
import datetime as dt
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker
from starlette.testclient import TestClient

from deferral.runtime.config import Settings
from deferral.store import serialized_dags
from deferral.store.serialized_dags import NOT_PARSED
from deferral.store.tables import DagRun, SerializedDag
from deferral_cli import main as deferral_main
from tests.integration.conftest import WEB_ADMIN_PASSWORD
from tests.parsed_dags import FolderRecorder, record_dags_folder
from webserver import users
from webserver.app import create_app

DAG_SOURCE = "from deferral import DAG\nfrom deferral.operators import EmptyOperator\n"


def _stored(sessions: sessionmaker[Session]) -> dict[str, object]:
    with sessions() as session:
        return dict(session.execute(select(SerializedDag.dag_id, SerializedDag.updated_at)).all())


def test_a_parse_rewrites_only_the_changed_dags_and_removes_the_gone_ones(
    settings: Settings, sessions: sessionmaker[Session], write_dag: Callable[[str, str], Path]
) -> None:
    for name in ("kept", "changed", "gone"):
        write_dag(name, f"{DAG_SOURCE}with DAG('{name}'):\n    EmptyOperator(task_id='a')\n")
    recorder = FolderRecorder(settings)
    try:
        recorder.record()
        first = _stored(sessions)
        assert set(first) == {"kept", "changed", "gone"}
        recorder.record()  # nothing changed: nothing rewritten
        assert _stored(sessions) == first
        write_dag("changed", f"{DAG_SOURCE}with DAG('changed'):\n    EmptyOperator(task_id='b')\n")
        (settings.dags_folder / "gone.py").unlink()
        recorder.record()
    finally:
        recorder.close()
    after = _stored(sessions)
    assert set(after) == {"kept", "changed"}
    assert after["kept"] == first["kept"] and after["changed"] != first["changed"]


def test_a_dag_that_fails_to_serialize_keeps_its_last_document(
    settings: Settings,
    sessions: sessionmaker[Session],
    write_dag: Callable[[str, str], Path],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    write_dag("odd", f"{DAG_SOURCE}with DAG('odd', tags=['v1']):\n    EmptyOperator(task_id='a')\n")
    record_dags_folder(settings)
    first = _stored(sessions)
    write_dag("odd", f"{DAG_SOURCE}with DAG('odd', tags=['v2']):\n    EmptyOperator(task_id='a')\n")
    write_dag("fine", f"{DAG_SOURCE}with DAG('fine'):\n    EmptyOperator(task_id='a')\n")
    real = serialized_dags.serialize_dag

    def refuses_odd(dag: Any) -> serialized_dags.StoredDag:
        if dag.dag_id == "odd":
            raise TypeError("cannot serialize")
        return real(dag)

    monkeypatch.setattr(serialized_dags, "serialize_dag", refuses_odd)
    record_dags_folder(settings)
    after = _stored(sessions)
    assert set(after) == {"odd", "fine"} and after["odd"] == first["odd"]


BASIC_ADMIN = "Basic " + base64.b64encode(f"admin:{WEB_ADMIN_PASSWORD}".encode()).decode()
SLEEPER = "import time\nwhile True:\n    time.sleep(1)\n"


def test_pages_commands_and_actions_never_import_a_dag_file(
    settings: Settings,
    sessions: sessionmaker[Session],
    service_env: dict[str, str],
    write_dag: Callable[[str, str], Path],
    tmp_path: Path,
) -> None:
    """A file that writes a marker when imported and one that sleeps for ever: the pages and
    `deferral dags list` answer at once, before and after a scheduler's parse, and so do the
    web UI's trigger, pause, clear and mark and `deferral dags trigger|pause`, `tasks
    clear|mark`; none writes the marker; the scheduler's parse records the sleeper as an
    import error."""
    marker = tmp_path / "imported"
    write_dag(
        "marks",
        f"import pathlib\npathlib.Path({str(marker)!r}).write_text('imported')\n"
        f"{DAG_SOURCE}with DAG('marks'):\n    EmptyOperator(task_id='a')\n",
    )
    sleeper = write_dag("sleeps", SLEEPER).resolve()
    quick = dataclasses.replace(settings, dagbag_import_timeout=1.0)

    app = create_app(
        quick, host="127.0.0.1", environ={users.ADMIN_PASSWORD_ENV: WEB_ADMIN_PASSWORD}
    )
    with TestClient(app, base_url="http://localhost") as web:
        # No scheduler has parsed yet: said, never read from the folder.
        page = web.get("/dags")
        assert page.status_code == 200 and NOT_PARSED in page.text
        assert web.get("/api/v1/dags").json()["notice"] == NOT_PARSED
        missing = web.get("/api/v1/dags/marks")
        assert missing.status_code == 404 and NOT_PARSED in missing.json()["error"]
        said = CliRunner().invoke(deferral_main, ["dags", "list"])
        assert (said.exit_code, said.stderr) == (1, f"error: {NOT_PARSED}\n")
        assert not marker.exists()

        parsed = record_dags_folder(quick)  # as the scheduler does: it imports the files
        assert parsed.import_errors[str(sleeper)].startswith("DagImportTimeout")
        marker.unlink()

        answer = web.get("/api/v1/dags").json()
        assert answer["notice"] is None
        assert [(d["dag_id"], d["loaded"], d["tasks"]) for d in answer["dags"]] == [
            ("marks", True, 1)
        ]
        assert [error["file"] for error in answer["import_errors"]] == [str(sleeper)]
        assert web.get("/dags/marks").status_code == 200
        listed = subprocess.run(
            [sys.executable, "-m", "deferral", "dags", "list"],
            env={**os.environ, **service_env, "DEFERRAL_DAGBAG_IMPORT_TIMEOUT": "1"},
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert listed.returncode == 1 and listed.stdout.splitlines()[1].startswith("marks ")
        assert listed.stderr.startswith(f"error: {sleeper}: DagImportTimeout")

        # The writes read the DAG's document: its params, timetable and task graph.
        admin = {"headers": {"authorization": BASIC_ADMIN}}
        api = "/api/v1/dags/marks"
        assert web.post(f"{api}/runs", json={"run_id": "web"}, **admin).status_code == 201
        assert web.post(f"{api}/pause", json={}, **admin).status_code == 200
        change = {"run_id": "web", "task_id": "a", "downstream": True}
        assert web.post(f"{api}/clear", json=change, **admin).status_code == 200
        marked = web.post(f"{api}/mark", json={**change, "state": "success"}, **admin)
        assert marked.status_code == 200
        for command in (
            ["dags", "trigger", "marks", "--run-id", "cli"],
            ["dags", "unpause", "marks"],
            ["dags", "next-run", "marks"],
            ["tasks", "clear", "marks", "cli", "a", "--downstream"],
            ["tasks", "mark", "marks", "cli", "a", "--state", "failed"],
        ):
            done = CliRunner().invoke(deferral_main, command)
            assert done.exit_code == 0, (command, done.output)
    assert not marker.exists()


OWN_TIMETABLE = """
import datetime as dt
import pathlib
from deferral import DAG
from deferral.operators import EmptyOperator
from deferral.timetables import DataInterval, NullTimetable

pathlib.Path({marker!r}).write_text("imported")


class LastHour(NullTimetable):
    def infer_manual_data_interval(self, *, run_after):
        return DataInterval(run_after - dt.timedelta(hours=1), run_after)


with DAG("own_timetable", schedule=LastHour()):
    EmptyOperator(task_id="a")
"""


def test_a_dag_files_own_timetable_is_the_one_trigger_that_imports_its_file(
    settings: Settings,
    sessions: sessionmaker[Session],
    write_dag: Callable[[str, str], Path],
    tmp_path: Path,
) -> None:
    """readmodel/DECISIONS.md 7: the document keeps no timetable for a class of the DAG file's
    own, so `dags trigger` and the web UI's trigger import that file, and only that file, for
    its manual interval: another DAG file beside it is not imported."""
    marker, other = tmp_path / "imported", tmp_path / "other imported"
    write_dag("own_timetable", OWN_TIMETABLE.format(marker=str(marker)))
    write_dag(
        "other",
        f"import pathlib\npathlib.Path({str(other)!r}).write_text('imported')\n"
        f"{DAG_SOURCE}with DAG('other'):\n    EmptyOperator(task_id='a')\n",
    )
    record_dags_folder(settings)
    marker.unlink()
    other.unlink()
    with sessions() as session:
        stored = serialized_dags.read_dag(session, "own_timetable")
    assert stored is not None and stored.timetable is None
    done = CliRunner().invoke(deferral_main, ["dags", "trigger", "own_timetable", "--run-id", "r"])
    assert done.exit_code == 0, done.output
    assert marker.exists()
    marker.unlink()
    app = create_app(
        settings, host="127.0.0.1", environ={users.ADMIN_PASSWORD_ENV: WEB_ADMIN_PASSWORD}
    )
    with TestClient(app, base_url="http://localhost") as web:
        answer = web.post(
            "/api/v1/dags/own_timetable/runs",
            json={"run_id": "web"},
            headers={"authorization": BASIC_ADMIN},
        )
    assert answer.status_code == 201, answer.text
    assert marker.exists() and not other.exists()
    with sessions() as session:
        runs = session.scalars(select(DagRun).order_by(DagRun.run_id)).all()
    assert [r.run_id for r in runs] == ["r", "web"]
    assert all(r.data_interval_end - r.data_interval_start == dt.timedelta(hours=1) for r in runs)
