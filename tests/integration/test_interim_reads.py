"""An interim read of the DAGs folder (deferral.loading.parsing: a slow file's readers hand over
what they have) leaves the DAGs and import errors of the files it has not read as they were."""

from __future__ import annotations

import datetime as dt

from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from deferral.dag import DAG
from deferral.loading.parsing import Parsed
from deferral.store.tables import Dag, DagImportError
from scheduler import dagruns, dags

NOW = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)


def _dag(dag_id: str) -> DAG:
    dag = DAG(dag_id)
    dag.fileloc = f"/dags/{dag_id}.py"
    return dag


def _record(sessions: sessionmaker[Session], read: Parsed) -> None:
    with sessions.begin() as session:
        dagruns.sync_dags(session, read, NOW, read.pending)
        dags.sync(session, read, read.pending)


def _rows(sessions: sessionmaker[Session]) -> tuple[dict[str, bool], dict[str, str]]:
    with sessions() as session:
        active = dict(session.execute(select(Dag.dag_id, Dag.is_active)).all())
        errors = dict(session.execute(select(DagImportError.filename, DagImportError.error)).all())
    return active, errors


def test_an_interim_read_leaves_what_its_pending_files_gave(
    sessions: sessionmaker[Session],
) -> None:
    slow, quick = _dag("in_slow_file"), _dag("in_quick_file")
    broken = {"/dags/broken.py": "RuntimeError: boom (line 1)"}
    _record(sessions, Parsed(NOW, {d.dag_id: d for d in (slow, quick)}, broken))

    pending = frozenset({"/dags/in_slow_file.py", "/dags/broken.py"})
    _record(sessions, Parsed(NOW, {"in_quick_file": quick}, {}, pending))
    assert _rows(sessions) == ({"in_slow_file": True, "in_quick_file": True}, broken)

    _record(sessions, Parsed(NOW, {"in_quick_file": quick}, {}))  # the final read
    assert _rows(sessions) == ({"in_slow_file": False, "in_quick_file": True}, {})
