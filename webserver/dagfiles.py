"""The DAG object of the one write that needs it: the trigger of a DAG whose timetable is its
file's own class, which only the file makes again (its manual run's interval;
readmodel/DECISIONS.md 7). Only that DAG's file is imported, first in a parse child within the
import timeout; no other file of the folder is read. Every other page and write reads the DAGs
the schedulers parsed (``readmodel.dags``)."""

from __future__ import annotations

from pathlib import Path

from deferral.dag import DAG
from deferral.loading.dagbag import DagBag, source_of
from deferral.loading.parsing import FolderParser


class DagFiles:
    """One DAG file of the folder at a time, read through a ``FolderParser`` (its parse child
    imports the file first, within the import timeout, and only a file that finished in time
    is imported here), so no DAG file can hang the web UI past that timeout."""

    def __init__(self, folder: Path, import_timeout: float) -> None:
        self._parser = FolderParser(DagBag(folder), import_timeout)

    def dag(self, dag_id: str, fileloc: str) -> DAG | None:
        """DAG ``dag_id`` of the file a scheduler parsed it from (``fileloc``), or None if that
        file is not of the folder or no longer gives it."""
        path = source_of(Path(fileloc))
        if not path.resolve().is_relative_to(self._parser.bag.folder):
            return None
        return self._parser.parse_file(path.resolve()).dags.get(dag_id)
