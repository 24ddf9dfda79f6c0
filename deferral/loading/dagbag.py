"""Finds DAGs in the DAGs folder as Airflow's DagBag does: Python files, and zip archives whose
top-level ``.py`` files define DAGs, minus what ``.deferralignore`` files leave out; cluster
policies (``deferral.loading.policies``) run on each DAG as it loads.

Each DAG file, and each top-level module of a zip, is imported under a name of its own
(``dag_module_name``: a prefix no package uses, a digest of its path in the folder, its stem),
so that a DAG file called ``json.py`` or ``scheduler.py`` replaces no module of the process that
reads it; a finder resolves those names in every process, so classes a DAG file defines
(operators, triggers) have a classpath every process can import. The folder and its zips go at
the *end* of ``sys.path``: helper modules of the folder are importable by their dotted path,
after the standard library and the installed packages.

A file's DAGs are its module globals holding a DAG, and, as in Airflow, every DAG used as a
context manager while the file was imported (``with DAG(...):`` unassigned, ``my_dag()`` of a
``@dag`` function) — except those another DAG file of the folder created (found with that
file instead).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import logging
import os
import re
import sys
import threading
import tomllib
import traceback
import zipfile
import zipimport
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any, Protocol

import pathspec

from deferral.dag import DAG, collecting_dags
from deferral.exceptions import (
    ClusterPolicyError,
    ClusterPolicySkipDag,
    ClusterPolicyViolation,
    DagDefinitionError,
    DagNotFound,
)
from deferral.loading import airflow_extra, airflow_imports
from deferral.loading.policies import (
    LOCAL_SETTINGS_MODULE,
    ClusterPolicies,
    apply_dag_policies,
    load_policies,
)
from deferral.runtime.config import airflow_imports as airflow_imports_on
from deferral.runtime.config import dag_ignore_file_syntax, load_settings
from deferral.runtime.process import raising_after

log = logging.getLogger("deferral.loading.dagbag")

IGNORE_FILE = ".deferralignore"
# The DAGs folder's own settings (TOML), for what the authors of its DAG files decide: today
# ``airflow_imports = true`` (DEFERRAL_AIRFLOW_IMPORTS, when set, overrides it).
FOLDER_SETTINGS_FILE = ".deferral.toml"
FOLDER_SETTINGS: dict[str, type] = {"airflow_imports": bool}
_COMMENT = re.compile(r"\s*#.*")
# The first part of a DAG module's name: no installed package, standard module or helper module
# of a DAGs folder is called so.
DAG_MODULE_PREFIX = "deferral_dagfile_"


# -- .deferralignore ------------------------------------------------------------------------------


@dataclass(frozen=True)
class _RegexpRule:
    """Airflow's default syntax: a path is ignored when the regexp is found anywhere in it,
    the path taken relative to the DAGs folder."""

    pattern: re.Pattern[str]
    folder: Path

    def verdict(self, path: Path, is_dir: bool) -> bool | None:
        return True if self.pattern.search(str(path.relative_to(self.folder))) else None


@dataclass(frozen=True)
class _GlobRule:
    """Airflow's ``glob`` syntax, which is .gitignore's: a pattern with a ``/`` at its start or
    in its middle is relative to the ignore file's folder, any other matches a name at any
    depth; ``!`` re-includes; a trailing ``/`` matches directories only; the last matching
    pattern decides."""

    pattern: pathspec.Pattern
    relative_to: Path | None

    def verdict(self, path: Path, is_dir: bool) -> bool | None:
        tested = str(path.relative_to(self.relative_to)) if self.relative_to else path.name
        if is_dir:
            tested += "/"
        return self.pattern.include if self.pattern.match_file(tested) else None


_Rule = _RegexpRule | _GlobRule


def _compile(line: str, syntax: str, folder: Path, ignore_file: Path) -> _Rule | None:
    """One line of an ignore file; None (and a warning) for a pattern that does not compile."""
    try:
        if syntax == "glob":
            if line.strip() == "/":
                return None  # matches nothing in .gitignore
            anchored = line.startswith("/") or "/" in line.rstrip("/")
            return _GlobRule(
                pathspec.util.lookup_pattern("gitignore")(line),
                ignore_file.parent if anchored else None,
            )
        return _RegexpRule(re.compile(line), folder)
    except (re.error, ValueError) as exc:
        log.warning("%s: ignoring the pattern %r: %s", ignore_file, line, exc)
        return None


def _read_rules(ignore_file: Path, syntax: str, folder: Path) -> list[_Rule]:
    try:
        text = ignore_file.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        log.warning("%s: cannot be read, its patterns do not apply: %s", ignore_file, exc)
        return []
    lines = (_COMMENT.sub("", line) for line in text.splitlines())
    rules = (_compile(line, syntax, folder, ignore_file) for line in lines if line.strip())
    return [rule for rule in rules if rule is not None and _is_pattern(rule)]


def _is_pattern(rule: _Rule) -> bool:
    return not isinstance(rule, _GlobRule) or rule.pattern.include is not None


def _ignored(path: Path, is_dir: bool, rules: Sequence[_Rule]) -> bool:
    """The last rule with a verdict decides (only glob rules can re-include)."""
    verdict = False
    for rule in rules:
        said = rule.verdict(path, is_dir)
        if said is not None:
            verdict = said
    return verdict


def _private(name: str) -> bool:
    return name.startswith(("_", "."))


def read_folder_settings(folder: Path) -> dict[str, Any]:
    """The settings of ``folder``'s FOLDER_SETTINGS_FILE (none if it has none); ValueError
    with one line naming the file and the key or line at fault."""
    path = folder / FOLDER_SETTINGS_FILE
    try:
        raw = path.read_text()
    except FileNotFoundError:
        return {}
    except OSError as exc:
        raise ValueError(f"{path}: {exc.strerror}") from None
    try:
        settings = tomllib.loads(raw)
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"{path}: not TOML: {exc}") from None
    for key, value in settings.items():
        wanted = FOLDER_SETTINGS.get(key)
        if wanted is None:
            known = ", ".join(sorted(FOLDER_SETTINGS))
            raise ValueError(f"{path}: unknown setting {key!r} (known: {known})")
        if not isinstance(value, wanted):
            raise ValueError(f"{path}: {key} must be a {wanted.__name__}, not {value!r}")
    return settings


def source_mtimes(paths: Sequence[Path]) -> dict[str, float]:
    """Each of ``paths`` that exists, with its mtime."""
    found: dict[str, float] = {}
    for path in paths:
        with contextlib.suppress(OSError):
            found[str(path)] = path.stat().st_mtime
    return found


def dag_sources(folder: Path, syntax: str | None = None) -> list[Path]:
    """The ``.py`` files and ``.zip`` archives of ``folder`` that may define DAGs, sorted.

    A ``.deferralignore`` in a folder applies to that folder and every folder below it (the
    rules of the folders above still apply); an ignored folder is not entered. Names starting
    with ``_`` or ``.``, and the ``deferral_local_settings`` module, are not DAG files."""
    syntax = syntax or dag_ignore_file_syntax()
    folder = folder.resolve()
    rules_of: dict[Path, list[_Rule]] = {folder: []}
    found: list[Path] = []
    for root, dirs, files in os.walk(folder, followlinks=True):
        here = Path(root)
        rules = list(rules_of[here.resolve()])
        if (here / IGNORE_FILE).is_file():
            rules += _read_rules(here / IGNORE_FILE, syntax, folder)
        dirs[:] = sorted(d for d in dirs if not _private(d) and not _ignored(here / d, True, rules))
        for name in list(dirs):
            real = (here / name).resolve()
            if real in rules_of:  # a link back up, or a second link to one folder
                log.warning("DAGs folder: not entering %s, already read as %s", here / name, real)
                dirs.remove(name)
                continue
            rules_of[real] = rules
        for name in files:
            path = here / name
            if (
                path.suffix in (".py", ".zip")
                and not _private(name)
                and not (here == folder and path.stem == LOCAL_SETTINGS_MODULE)
                and not _ignored(path, False, rules)
            ):
                found.append(path)
    return sorted(found)


# -- importing ------------------------------------------------------------------------------------


def put_on_sys_path(folder: Path) -> None:
    """Make modules of the DAGs folder importable by their dotted path, and top-level modules
    of its zip archives by their name, after everything else on ``sys.path`` (a helper module
    named like a standard or installed module never replaces it); and DAG modules by their
    ``dag_module_name`` (operators and triggers defined there get a classpath every process can
    import, the triggerer included, even for an archive added later)."""
    entry = str(folder.resolve())
    if entry not in sys.path:
        sys.path.append(entry)
    if not any(isinstance(f, _DagFolderFinder) and f.folder == Path(entry) for f in sys.meta_path):
        sys.meta_path.append(_DagFolderFinder(Path(entry)))


def _put_zip_on_sys_path(archive: Path, folder: Path) -> None:
    """Right after the DAGs folder, so that the archive's modules come after the folder's own
    files and after the installed ones."""
    entry = str(archive)
    if entry not in sys.path:
        at = sys.path.index(str(folder)) + 1 if str(folder) in sys.path else len(sys.path)
        sys.path.insert(at, entry)


def dag_module_name(folder: Path, path: Path, inner: str | None = None) -> str:
    """The module name DAG file ``path`` (or top-level module ``inner`` of zip ``path``) is
    imported under, the same in every process reading ``folder``: a prefix no other module
    has, a digest of its place in the folder, and its stem for the eye (Airflow's way)."""
    place = path.relative_to(folder).as_posix() + (f"/{inner}.py" if inner else "")
    digest = hashlib.sha1(place.encode(), usedforsecurity=False).hexdigest()[:16]
    stem = re.sub(r"\W", "_", inner if inner is not None else path.stem)
    return f"{DAG_MODULE_PREFIX}{digest}_{stem}"


class _DagFolderFinder(importlib.abc.MetaPathFinder):
    """Consulted only when no other finder knows a top-level module: a DAG module's name
    (``dag_module_name``) is its file's, and another name is looked for in the DAGs folder's zip
    archives (the archive that has it goes on sys.path). It never raises: a finder that did
    would break imports that have nothing to do with DAGs."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self._searching = threading.local()

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if path is not None or getattr(self._searching, "active", False):
            return None
        self._searching.active = True  # what the search itself imports is not searched for
        try:
            if fullname.startswith(DAG_MODULE_PREFIX):
                return _dag_module_spec(self.folder, fullname)
            for archive in dag_sources(self.folder):
                if archive.suffix != ".zip" or str(archive) in sys.path:
                    continue
                spec = _zip_spec(archive, fullname)
                if spec is not None:
                    _put_zip_on_sys_path(archive, self.folder)
                    return spec
        except Exception:
            log.debug(
                "looking for %r in the DAGs folder's archives failed", fullname, exc_info=True
            )
        finally:
            self._searching.active = False
        return None


def _dag_module_spec(folder: Path, name: str) -> importlib.machinery.ModuleSpec | None:
    """The spec of the DAG module called ``name`` in ``folder``, if one is."""
    for source in dag_sources(folder):
        if source.suffix == ".zip":
            for inner in _zip_module_names(source):
                if dag_module_name(folder, source, inner) == name:
                    _put_zip_on_sys_path(source, folder)
                    return _zipped_dag_module_spec(source, inner, name)
        elif dag_module_name(folder, source) == name:
            return _dag_file_spec(folder, source, name)
    return None


class _DagFileLoader(importlib.machinery.SourceFileLoader):
    """Runs a DAG file under its DAG module name, its relative imports relative to the package
    its folder is (if it is one), as when it was imported by its dotted path."""

    def __init__(self, name: str, path: str, package: str) -> None:
        super().__init__(name, path)
        self.package = package

    def exec_module(self, module: ModuleType) -> None:
        module.__package__ = self.package
        super().exec_module(module)


def _dag_file_spec(folder: Path, path: Path, name: str) -> importlib.machinery.ModuleSpec:
    parent = path.parent
    is_package = parent != folder and (parent / "__init__.py").exists()
    package = ".".join(parent.relative_to(folder).parts) if is_package else ""
    spec = importlib.util.spec_from_file_location(
        name, path, loader=_DagFileLoader(name, str(path), package)
    )
    assert spec is not None
    return spec


class _ZippedDagModuleLoader(importlib.abc.Loader):
    """Runs top-level module ``inner`` of a zip under a DAG module's name (``zipimporter`` runs
    a module only under the name it has in the archive)."""

    def __init__(self, archive: Path, inner: str) -> None:
        self.archive = archive
        self.inner = inner

    def exec_module(self, module: ModuleType) -> None:
        importer = zipimport.zipimporter(str(self.archive))
        importer.invalidate_caches()  # the archive may have changed since it was last read
        code = importer.get_code(self.inner)
        module.__file__ = str(self.archive / f"{self.inner}.py")
        exec(code, vars(module))


def _zipped_dag_module_spec(archive: Path, inner: str, name: str) -> importlib.machinery.ModuleSpec:
    return importlib.machinery.ModuleSpec(
        name, _ZippedDagModuleLoader(archive, inner), origin=str(archive / f"{inner}.py")
    )


def _zip_spec(archive: Path, name: str) -> importlib.machinery.ModuleSpec | None:
    try:
        importer = zipimport.zipimporter(str(archive))
        importer.invalidate_caches()  # the archive may have changed since it was last read
        return importer.find_spec(name)
    except (zipimport.ZipImportError, OSError):
        return None


def _zip_module_names(archive: Path) -> list[str]:
    """The archive's top-level ``.py`` files, as module names: the files Airflow reads DAGs
    from (the archive's folders are packages those files may import)."""
    with zipfile.ZipFile(archive) as opened:
        names = opened.namelist()
    return sorted(n[: -len(".py")] for n in names if n.endswith(".py") and "/" not in n)


def _forget_modules_of(archive: Path) -> None:
    """Drop the modules imported from an older copy of ``archive`` (its packages included)."""
    inside = str(archive) + os.sep
    for name, module in list(sys.modules.items()):
        if (getattr(module, "__file__", None) or "").startswith(inside):
            del sys.modules[name]


def _import_as(spec: importlib.machinery.ModuleSpec) -> ModuleType:
    """The module of ``spec``, run afresh under its name."""
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    # Not importlib.reload: a reload keeps the globals the new source no longer defines, so a
    # DAG removed from its file would stay found.
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(spec.name, None)
        raise
    return module


def _one_line_error(exc: BaseException, path: Path) -> str:
    """``Type: first line of the message (line N)``, N being the line of the DAG file itself."""
    if isinstance(exc, SyntaxError):
        message, line = exc.msg, exc.lineno
    else:
        message = str(exc)
        in_file = [f for f in traceback.extract_tb(exc.__traceback__) if f.filename == str(path)]
        line = in_file[-1].lineno if in_file else getattr(exc, "line", None)
    first = message.strip().splitlines()[0] if message.strip() else ""
    where = f" (line {line})" if line is not None else ""
    extra = airflow_extra.hint(exc)
    return f"{type(exc).__name__}: {first}{where}" + (f": {extra}" if extra else "")


class FolderContents(Protocol):
    """What a read of the DAGs folder found: a DagBag, or a scheduler's finished parse."""

    @property
    def dags(self) -> Mapping[str, DAG]: ...

    @property
    def import_errors(self) -> Mapping[str, str]: ...


class DagImportTimeout(Exception):
    """A DAG file took longer than ``DEFERRAL_DAGBAG_IMPORT_TIMEOUT`` to import."""


def timeout_message(timeout: float) -> str:
    return (
        f"DagImportTimeout: importing the file took longer than {timeout:g} s "
        "(DEFERRAL_DAGBAG_IMPORT_TIMEOUT)"
    )


@contextlib.contextmanager
def _time_limit(timeout: float | None) -> Iterator[None]:
    """Raise DagImportTimeout in the import after ``timeout`` seconds (a SIGALRM: only in the
    main thread, as Airflow's DagBag does; elsewhere the caller bounds the import)."""
    if not timeout or threading.current_thread() is not threading.main_thread():
        yield
        return
    message = timeout_message(timeout).removeprefix("DagImportTimeout: ")
    with raising_after(timeout, lambda: DagImportTimeout(message)):
        yield


@dataclass
class _Loaded:
    """What one DAG file or archive gave at one mtime (and with the import hook on or off)."""

    mtime: float
    airflow_imports: bool = False
    dags: list[DAG] = field(default_factory=list)
    error: str | None = None


class DagBag:
    def __init__(
        self,
        folder: Path,
        *,
        ignore_syntax: str | None = None,
        policies: ClusterPolicies | None = None,
        import_timeout: float | None = None,
    ) -> None:
        self.folder = folder.resolve()
        self.ignore_syntax = ignore_syntax
        # None: the deferral_local_settings module, read when the folder is on sys.path.
        self.policies = policies
        # Seconds a file may take to import, where the bag imports in the main thread.
        self.import_timeout = import_timeout
        self.dags: dict[str, DAG] = {}
        self.import_errors: dict[str, str] = {}
        self._loaded: dict[Path, _Loaded] = {}
        # Every DAG file and archive the last collect listed, with its mtime then.
        self.listed: dict[str, float] = {}
        # The module names of every DAG file and archive of the folder, at the last collect.
        self._dag_modules: set[str] = set()
        # Whether DAG files may import from ``airflow``, as decided at the last collect.
        self._airflow_imports = False

    def collect(
        self, known: Mapping[str, tuple[float, str]] | None = None, pending: Sequence[Path] = ()
    ) -> DagBag:
        """(Re)load the folder; a file or archive whose mtime changed is re-imported, except
        one ``known`` (path -> (mtime, error)) to fail at that mtime: it is not imported, and
        one ``pending``: it keeps what it gave before (nothing if it is new)."""
        start = self._start()
        if start is None:
            return self
        policies, errors, claimed = start
        loaded: dict[Path, _Loaded] = {}
        for path in claimed:
            if path not in pending:
                loaded[path] = self._load(path, policies, known or {})
            elif path in self._loaded:
                loaded[path] = self._loaded[path]
        self._loaded = loaded
        self._gather(errors)
        return self

    def collect_file(self, path: Path) -> DagBag:
        """Load (again, if its mtime changed) only DAG file or archive ``path``, keeping what
        the bag had of the others: a process that runs one DAG's tasks imports one file."""
        start = self._start()
        if start is None:
            return self
        policies, errors, claimed = start
        if path not in claimed:
            errors[str(path)] = errors.get(str(path), f"not a DAG file of {self.folder}")
        else:
            self._loaded[path] = self._load(path, policies, {})
        self._gather(errors)
        return self

    def stale_sources(self) -> list[Path]:
        """The DAG files and archives the next collect would import (new or changed)."""
        sources = dag_sources(self.folder, self.ignore_syntax) if self.folder.is_dir() else []
        return [path for path in sources if not self._cached(path, self._loaded.get(path))]

    def probe(
        self, paths: Sequence[Path], starting: Callable[[Path], None]
    ) -> Iterator[tuple[Path, float, str | None]]:
        """Import each of ``paths`` as a collect would, within ``import_timeout``, calling
        ``starting`` before each: (path, its mtime, its error or None). For a parse child,
        whose DAG objects are thrown away."""
        start = self._start()
        if start is None:
            return
        policies, _, claimed = start
        for path in paths:
            if path not in claimed:
                continue
            starting(path)
            with contextlib.suppress(OSError):
                loaded = self._load(path, policies, {})
                yield path, loaded.mtime, loaded.error

    def _start(self) -> tuple[ClusterPolicies, dict[str, str], list[Path]] | None:
        """The policies, the errors so far and the sources to load; None when the policy
        module fails to import (then nothing loads)."""
        if not self.folder.is_dir():
            raise DagNotFound(f"DAGs folder {self.folder} does not exist")
        put_on_sys_path(self.folder)
        importlib.invalidate_caches()
        try:
            policies = self.policies if self.policies is not None else load_policies()
        except Exception as exc:
            # Fail closed: DAGs loaded without the cluster's policies could break its rules.
            where = _local_settings_origin()
            self.dags, self.import_errors = {}, {where: _one_line_error(exc, Path(where))}
            return None
        errors: dict[str, str] = {}
        try:
            folder_settings = read_folder_settings(self.folder)
        except ValueError as exc:
            # Said for the file; the DAG files load as if it were not there.
            errors[str(self.folder / FOLDER_SETTINGS_FILE)] = str(exc)
            folder_settings = {}
        self._airflow_imports = airflow_imports_on(folder_settings.get("airflow_imports", False))
        sources = dag_sources(self.folder, self.ignore_syntax)
        self.listed = source_mtimes(sources)
        claimed = self._claim_module_names(sources, errors)
        self._dag_modules = {
            name
            for path in claimed
            for inner in self._module_names(path)
            for name in (inner, self._dag_module_name(path, inner))
        }
        return policies, errors, claimed

    def _gather(self, errors: dict[str, str]) -> None:
        dags: dict[str, DAG] = {}
        for path, loaded in self._loaded.items():
            if loaded.error:
                errors[str(path)] = loaded.error
            for dag in loaded.dags:
                if dag.dag_id in dags and dags[dag.dag_id] is not dag:
                    errors[str(path)] = (
                        f"DAG {dag.dag_id!r} is also defined in {dags[dag.dag_id].fileloc}"
                    )
                    continue
                dags[dag.dag_id] = dag
        self.dags, self.import_errors = dags, errors

    def _claim_module_names(self, sources: Sequence[Path], errors: dict[str, str]) -> list[Path]:
        """The sources whose module names no other source took first, files before archives
        as on sys.path: a helper import of one name must import one file in every process."""
        owner: dict[str, Path] = {}
        claimed: list[Path] = []
        for path in sorted(sources, key=lambda p: (p.suffix == ".zip", p)):
            try:
                names = self._module_names(path)
            except (zipfile.BadZipFile, OSError) as exc:
                errors[str(path)] = f"{type(exc).__name__}: {exc}"
                continue
            taken = [n for n in names if n in owner]
            if taken:
                errors[str(path)] = f"module {taken[0]!r} is also defined in {owner[taken[0]]}"
                continue
            owner.update(dict.fromkeys(names, path))
            claimed.append(path)
        return sorted(claimed)

    def _module_names(self, path: Path) -> list[str]:
        """The dotted names ``path``'s modules are importable by as helpers."""
        if path.suffix == ".zip":
            return _zip_module_names(path)
        return [".".join(path.relative_to(self.folder).with_suffix("").parts)]

    def _dag_module_name(self, path: Path, inner: str) -> str:
        return dag_module_name(self.folder, path, inner if path.suffix == ".zip" else None)

    def _cached(self, path: Path, cached: _Loaded | None) -> bool:
        try:
            mtime = path.stat().st_mtime
        except OSError:
            return False
        return cached is not None and (cached.mtime, cached.airflow_imports) == (
            mtime,
            self._airflow_imports,
        )

    def _load(
        self, path: Path, policies: ClusterPolicies, known: Mapping[str, tuple[float, str]]
    ) -> _Loaded:
        """What ``path`` defines, read again only when its mtime changed (so policies run once
        on the DAG objects this bag serves)."""
        mtime = path.stat().st_mtime
        cached = self._loaded.get(path)
        if cached is not None and self._cached(path, cached):
            return cached
        loaded = _Loaded(mtime, self._airflow_imports)
        failed = known.get(str(path))
        if failed is not None and failed[0] == mtime:
            loaded.error = failed[1]
            return loaded
        if path.suffix == ".zip":
            _put_zip_on_sys_path(path, self.folder)
            _forget_modules_of(path)
        airflow_paths = airflow_imports.active if self._airflow_imports else contextlib.nullcontext
        for inner in self._module_names(path):
            fileloc = path / f"{inner}.py" if path.suffix == ".zip" else path
            name = self._dag_module_name(path, inner)
            spec = (
                _zipped_dag_module_spec(path, inner, name)
                if path.suffix == ".zip"
                else _dag_file_spec(self.folder, path, name)
            )
            try:
                with (
                    collecting_dags() as collected,
                    airflow_paths(),
                    _time_limit(self.import_timeout),
                ):
                    module = _import_as(spec)
            except Exception as exc:
                loaded.error = _one_line_error(exc, fileloc)
                continue
            others = self._dag_modules - {name}
            registered = [dag for dag, creator in collected if creator not in others]
            found = [value for value in vars(module).values() if isinstance(value, DAG)]
            for dag in dict.fromkeys([*found, *registered]):
                self._bag(dag, str(fileloc), policies, loaded)
        return loaded

    def _bag(self, dag: DAG, fileloc: str, policies: ClusterPolicies, loaded: _Loaded) -> None:
        """Validate ``dag`` and run the cluster policies on it, as Airflow's bag_dag does."""
        dag.fileloc = fileloc
        try:
            dag.validate()
            apply_dag_policies(dag, policies)
        except ClusterPolicySkipDag:
            return
        except (DagDefinitionError, ClusterPolicyViolation, ClusterPolicyError) as exc:
            loaded.error = _one_line_error(exc, Path(fileloc))
            return
        loaded.dags.append(dag)

    def get_dag(self, dag_id: str, fileloc: str | None = None) -> DAG:
        """DAG ``dag_id``; when the bag lacks it, the folder is read again, or only ``fileloc``
        (the file the DAG was last parsed from) when given."""
        dag = self.dags.get(dag_id)
        if dag is None:
            if fileloc is not None and Path(fileloc).is_relative_to(self.folder):
                self.collect_file(source_of(Path(fileloc)))
            else:
                self.collect()
            dag = self.dags.get(dag_id)
        if dag is None:
            raise DagNotFound(f"DAG {dag_id!r} not found in {self.folder}")
        return dag


def source_of(fileloc: Path) -> Path:
    """The DAG file or archive of a DAG's ``fileloc`` (a zipped DAG's names the module inside)."""
    return fileloc.parent if fileloc.parent.suffix == ".zip" else fileloc


@functools.cache
def process_dagbag() -> DagBag:
    """This process's bag of the DAGs folder (``DEFERRAL_DAGS_FOLDER``): the one a task process
    runs its tasks from, and where an operator naming another DAG (TriggerDagRunOperator,
    ExternalTaskSensor) finds it, so that no DAG file is imported twice in one process."""
    settings = load_settings()
    return DagBag(settings.dags_folder, import_timeout=settings.dagbag_import_timeout)


def _local_settings_origin() -> str:
    """Where ``deferral_local_settings`` lives, to key its import error by."""
    try:
        spec = importlib.util.find_spec(LOCAL_SETTINGS_MODULE)
    except (ImportError, ValueError):
        spec = None
    return spec.origin if spec is not None and spec.origin else LOCAL_SETTINGS_MODULE
