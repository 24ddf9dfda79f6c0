"""Finds DAGs in the Python files of the DAGs folder.

The folder goes on ``sys.path`` and each file is imported under its dotted path, so classes a DAG
file defines (operators, triggers) have an importable classpath in every process.
"""

from __future__ import annotations

import importlib
import sys
import traceback
from pathlib import Path
from types import ModuleType

from deferral.dag import DAG, DagDefinitionError


class DagNotFound(LookupError):
    pass


def put_on_sys_path(folder: Path) -> None:
    """Make modules of the DAGs folder importable by their dotted path (operators and triggers
    defined there get a classpath every process can import)."""
    entry = str(folder.resolve())
    if entry not in sys.path:
        sys.path.insert(0, entry)


def _module_name(folder: Path, path: Path) -> str:
    return ".".join(path.relative_to(folder).with_suffix("").parts)


def _dag_files(folder: Path) -> list[Path]:
    return sorted(
        p
        for p in folder.rglob("*.py")
        if not any(part.startswith(("_", ".")) for part in p.relative_to(folder).parts)
    )


def _one_line_error(exc: BaseException, path: Path) -> str:
    """``Type: first line of the message (line N)``, N being the line of the DAG file itself."""
    if isinstance(exc, SyntaxError):
        message, line = exc.msg, exc.lineno
    else:
        message = str(exc)
        in_file = [f for f in traceback.extract_tb(exc.__traceback__) if f.filename == str(path)]
        line = in_file[-1].lineno if in_file else None
    first = message.strip().splitlines()[0] if message.strip() else ""
    where = f" (line {line})" if line is not None else ""
    return f"{type(exc).__name__}: {first}{where}"


class DagBag:
    def __init__(self, folder: Path) -> None:
        self.folder = folder.resolve()
        self.dags: dict[str, DAG] = {}
        self.import_errors: dict[str, str] = {}
        self._mtimes: dict[Path, float] = {}

    def collect(self) -> DagBag:
        """(Re)load the folder; a file whose mtime changed is re-imported."""
        if not self.folder.is_dir():
            raise DagNotFound(f"DAGs folder {self.folder} does not exist")
        put_on_sys_path(self.folder)
        importlib.invalidate_caches()
        dags: dict[str, DAG] = {}
        errors: dict[str, str] = {}
        for path in _dag_files(self.folder):
            try:
                module = self._load(path)
            except Exception as exc:
                errors[str(path)] = _one_line_error(exc, path)
                continue
            for value in vars(module).values():
                if not isinstance(value, DAG):
                    continue
                if value.dag_id in dags and dags[value.dag_id] is not value:
                    errors[str(path)] = (
                        f"DAG {value.dag_id!r} is also defined in {dags[value.dag_id].fileloc}"
                    )
                    continue
                try:
                    value.validate()
                except DagDefinitionError as exc:
                    errors[str(path)] = str(exc)
                    continue
                value.fileloc = str(path)
                dags[value.dag_id] = value
        self.dags, self.import_errors = dags, errors
        return self

    def _load(self, path: Path) -> ModuleType:
        name = _module_name(self.folder, path)
        mtime = path.stat().st_mtime
        module = sys.modules.get(name)
        if module is not None and getattr(module, "__file__", None) != str(path):
            del sys.modules[name]  # same module name from another folder: not ours to reuse
            module = None
        if module is not None and self._mtimes.get(path) == mtime:
            return module
        module = importlib.reload(module) if module is not None else importlib.import_module(name)
        self._mtimes[path] = mtime
        return module

    def get_dag(self, dag_id: str) -> DAG:
        dag = self.dags.get(dag_id)
        if dag is None:
            self.collect()
            dag = self.dags.get(dag_id)
        if dag is None:
            raise DagNotFound(f"DAG {dag_id!r} not found in {self.folder}")
        return dag
