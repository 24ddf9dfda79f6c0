"""The DAG objects of the one write that needs them: the trigger of a DAG whose timetable is its
file's own class, which only the file makes again (its manual run's interval;
readmodel/DECISIONS.md 7): the DAGs folder as this process reads it, each changed file
imported first in a parse child within the import timeout. Every other page and write reads
the DAGs the schedulers parsed (``readmodel.dags``)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from deferral.dag import DAG
from deferral.loading.dagbag import DagBag
from deferral.loading.parsing import FolderParser, Parsed

# The DAGs folder is scanned again at most this often (a file's DAGs are re-imported only when
# its mtime changed).
DAG_RESCAN_SEC = 5.0
# The longest a write waits for a read of the DAGs folder it started.
PARSE_WAIT_SEC = 5.0


class DagFiles:
    """The DAGs folder as this process sees it, read again at most every DAG_RESCAN_SEC through
    a ``FolderParser`` (a parse child imports each changed file first, within the import
    timeout, and a thread of its own then loads it): a write waits for that read at most
    PARSE_WAIT_SEC, then uses the last one, so no DAG file can hang the web UI."""

    def __init__(self, folder: Path, import_timeout: float) -> None:
        self._parser = FolderParser(DagBag(folder), import_timeout)
        self._lock = threading.Lock()
        self._scanned_at: float | None = None
        self._parsed: Parsed | None = None

    def dag(self, dag_id: str) -> DAG | None:
        with self._lock:
            now = time.monotonic()
            if self._scanned_at is None or now - self._scanned_at >= DAG_RESCAN_SEC:
                self._scanned_at = now
                if self._parser.bag.folder.is_dir():
                    self._parser.start()
                    self._parser.wait(PARSE_WAIT_SEC)
            self._parsed = self._parser.take() or self._parsed
            return self._parsed.dags.get(dag_id) if self._parsed is not None else None
