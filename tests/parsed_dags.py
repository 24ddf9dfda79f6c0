"""What a running scheduler does for the web UI and the CLI, for the tests that read them: parse
the DAGs folder (``FolderParser``: a parse child within the import timeout) and record it with
the scheduler's own writer (``scheduler.dags.record``: the ``dag``, ``import_error`` and
``serialized_dag`` rows). The web UI and the display commands never import a DAG file
(readmodel/DECISIONS.md 5): a test that writes DAG files records them before it reads."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any

from sqlalchemy.orm import Session, sessionmaker
from starlette.testclient import TestClient

from deferral.loading.dagbag import DagBag
from deferral.loading.parsing import FolderParser, Parsed
from deferral.runtime.config import Settings
from deferral.store.db import make_engine, make_sessionmaker
from scheduler import dags


class FolderRecorder:
    """A scheduler's parse of ``settings``' DAGs folder, recorded on demand (a file is imported
    again only when it changed, as the scheduler's own parser does)."""

    def __init__(self, settings: Settings, pooling: str | None = None) -> None:
        self.folder = settings.dags_folder
        self.parser = FolderParser(DagBag(self.folder), settings.dagbag_import_timeout)
        # ``pooling``: the services' DEFERRAL_DATABASE_POOLING, when it is not this process's.
        self.engine = make_engine(settings.database_url, pooling=pooling)
        self.sessions: sessionmaker[Session] = make_sessionmaker(self.engine)
        # The folder's files as the last record began, if it read every DAG file (none pending).
        self._recorded: dict[str, tuple[int, int]] | None = None

    def record(self) -> Parsed:
        before = folder_files(self.folder)
        parsed = self.parser.parse()
        settled = self.parser.settled(parsed)
        with self.sessions.begin() as session:
            dags.record(session, str(self.folder), settled)
        self._recorded = None if settled.pending else before
        return parsed

    def record_if_changed(self) -> None:
        """Record, unless no file of the folder (DAG files, ignore files, its settings) was
        added, changed or removed since the last record began: a scheduler's parse would write
        the same rows again (a record before each of a test's hundreds of requests was most of
        its time)."""
        if folder_files(self.folder) != self._recorded:
            self.record()

    def close(self) -> None:
        self.parser.close()
        self.engine.dispose()


def folder_files(folder: Path) -> dict[str, tuple[int, int]]:
    """Every file under ``folder``, with its mtime and size."""
    found: dict[str, tuple[int, int]] = {}
    for root, _, files in os.walk(folder, followlinks=True):
        for name in files:
            path = os.path.join(root, name)
            with contextlib.suppress(OSError):
                stat = os.stat(path)
                found[path] = (stat.st_mtime_ns, stat.st_size)
    return found


def record_dags_folder(settings: Settings, pooling: str | None = None) -> Parsed:
    """Parse ``settings``' DAGs folder and record it, as a scheduler does after each parse."""
    recorder = FolderRecorder(settings, pooling)
    try:
        return recorder.record()
    finally:
        recorder.close()


class ParsedClient(TestClient):
    """A web UI client beside a running scheduler: the DAGs folder, if it is there, is parsed
    and recorded before each request when it changed since the last record (only its changed
    files are imported again)."""

    def __init__(self, app: Any, settings: Settings, **kwargs: Any) -> None:
        super().__init__(app, **kwargs)
        self.recorder = FolderRecorder(settings)

    def request(self, *args: Any, **kwargs: Any) -> Any:
        if self.recorder.folder.is_dir():
            self.recorder.record_if_changed()
        return super().request(*args, **kwargs)

    def __exit__(self, *exc: Any) -> None:
        self.recorder.close()
        super().__exit__(*exc)
