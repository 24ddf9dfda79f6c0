"""An interim read of the DAGs folder (deferral.loading.parsing: a slow file's readers hand over
what they have) leaves the DAGs and import errors of the files it has not read as they were."""

from __future__ import annotations

import datetime as dt
import os
import time
from pathlib import Path

from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from deferral.dag import DAG
from deferral.loading.dagbag import DagBag
from deferral.loading.parsing import FolderParser, Parsed
from deferral.store.tables import Dag, DagImportError, SerializedDag
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


# -- a read that began before a file changed -------------------------------------------------

_DAG_FILE = """
from deferral import DAG
from deferral.operators.empty import EmptyOperator

with DAG({dag_id!r}, schedule=None):
    EmptyOperator(task_id="only")
"""


def _write(folder: Path, dag_id: str) -> None:
    (folder / f"{dag_id}.py").write_text(_DAG_FILE.format(dag_id=dag_id))


def _recorded(sessions: sessionmaker[Session]) -> tuple[dict[str, bool], set[str]]:
    with sessions() as session:
        active = dict(session.execute(select(Dag.dag_id, Dag.is_active)).all())
        documents = set(session.scalars(select(SerializedDag.dag_id)))
    return active, documents


def _record_read(sessions: sessionmaker[Session], parser: FolderParser, read: Parsed) -> None:
    with sessions.begin() as session:
        dags.record(session, str(parser.bag.folder), parser.settled(read))


def test_a_read_begun_before_a_file_was_written_does_not_undo_a_newer_read(
    sessions: sessionmaker[Session], tmp_path: Path
) -> None:
    """Two schedulers (or a scheduler and `dags test`) read the folder: the one whose read began
    before a new file was written records last. The new DAG stays active with its document (a
    `dags trigger` in between would say it does not exist)."""
    _write(tmp_path, "before_both")
    old = FolderParser(DagBag(tmp_path), 0)
    older_read = old.parse()
    _write(tmp_path, "written_between")
    new = FolderParser(DagBag(tmp_path), 0)
    _record_read(sessions, new, new.parse())
    assert _recorded(sessions) == (
        {"before_both": True, "written_between": True},
        {"before_both", "written_between"},
    )

    _record_read(sessions, old, older_read)
    assert _recorded(sessions) == (
        {"before_both": True, "written_between": True},
        {"before_both", "written_between"},
    )

    _record_read(sessions, old, old.parse())  # its next read sees the file
    assert _recorded(sessions)[0] == {"before_both": True, "written_between": True}


def test_a_read_begun_before_a_file_was_removed_does_not_bring_its_dag_back(
    sessions: sessionmaker[Session], tmp_path: Path
) -> None:
    _write(tmp_path, "stays")
    _write(tmp_path, "removed_between")
    old = FolderParser(DagBag(tmp_path), 0)
    older_read = old.parse()
    _record_read(sessions, old, older_read)
    (tmp_path / "removed_between.py").unlink()
    new = FolderParser(DagBag(tmp_path), 0)
    _record_read(sessions, new, new.parse())
    assert _recorded(sessions) == ({"stays": True, "removed_between": False}, {"stays"})

    _record_read(sessions, old, older_read)  # recorded once more, late
    assert _recorded(sessions) == ({"stays": True, "removed_between": False}, {"stays"})


def test_a_file_with_an_mtime_ahead_of_the_clock_is_recorded(
    sessions: sessionmaker[Session], tmp_path: Path
) -> None:
    """A file unpacked with a future mtime is read as it is: files are compared by mtime as
    listed, not against a clock, or it would never be recorded."""
    _write(tmp_path, "from_the_future")
    ahead = time.time() + 3600
    os.utime(tmp_path / "from_the_future.py", (ahead, ahead))
    parser = FolderParser(DagBag(tmp_path), 0)
    _record_read(sessions, parser, parser.parse())
    assert _recorded(sessions) == ({"from_the_future": True}, {"from_the_future"})


def test_a_file_written_just_before_a_read_is_recorded_by_it(
    sessions: sessionmaker[Session], tmp_path: Path
) -> None:
    """The everyday case: a DAG file written, and the folder read at once (`dags test`, a
    scheduler's start, the tests' own recorder)."""
    parser = FolderParser(DagBag(tmp_path), 0)
    _write(tmp_path, "written_now")
    _record_read(sessions, parser, parser.parse())
    assert _recorded(sessions) == ({"written_now": True}, {"written_now"})
