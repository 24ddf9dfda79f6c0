"""The layout follows the data, and each rule is checked here on the source, so a new import that
breaks a wall fails at once.

Between packages: ``deferral`` (core) imports neither ``broker`` nor a service nor the read model,
the web UI or the CLI; services import ``deferral`` and ``broker`` but never each other; ``broker``
imports no service and nothing of the authoring SDK; the read model imports neither the web UI,
the CLI nor a service, nor DAG loading (``deferral.loading``: it reads the parsed DAGs); the
web UI imports no service and nothing of the CLI; ``deferral_healthcheck`` imports no project
package (it runs in a container's healthcheck, beside any process); ``migrations`` imports only
the store.

Inside a service, no class is over 400 lines (split by job into modules of its package), and
what every service does (consumers, registration, poison entries) is written once, in
``broker/service.py``.

Inside the core: the authoring SDK (the public modules at ``deferral/``'s root and its public
packages, and ``deferral/authoring/``) reaches the store and DAG loading through one seam,
``deferral.store.seam``; and no module of the core imports, however late, a module that imports
it back (a cycle), so each part can be read, tested and loaded after what it builds on.

``importlib.import_module("...")`` with a literal name counts as an import wherever it is."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PROJECT = {
    "deferral",
    "deferral_cli",
    "deferral_healthcheck",
    "broker",
    "readmodel",
    "scheduler",
    "worker",
    "triggerer",
    "webserver",
    "migrations",
}
SERVICES = {"scheduler", "worker", "triggerer"}
FORBIDDEN = {
    "deferral": {"broker", "readmodel", "webserver", "deferral_cli", *SERVICES},
    "broker": {"readmodel", "webserver", "deferral_cli", *SERVICES},
    "readmodel": {"webserver", "deferral_cli", *SERVICES},
    "scheduler": {"deferral_cli", "readmodel", "webserver", "worker", "triggerer"},
    "worker": {"deferral_cli", "readmodel", "webserver", "scheduler", "triggerer"},
    "triggerer": {"deferral_cli", "readmodel", "webserver", "scheduler", "worker"},
    # The web UI reads the services' tables, never their code.
    "webserver": {"deferral_cli", *SERVICES},
    "deferral_healthcheck": PROJECT - {"deferral_healthcheck"},
}
# Program entry points, not library code: ``python -m deferral`` runs the command.
ENTRY_POINTS = {ROOT / "deferral" / "__main__.py"}

# The authoring SDK: what DAG files import, and its inner parts.
SDK_PACKAGES = (
    "deferral.authoring",
    "deferral.decorators",
    "deferral.hooks",
    "deferral.models",
    "deferral.operators",
    "deferral.sensors",
    "deferral.timetables",
    "deferral.triggers",
    "deferral.utils",
)
INNER_PARTS = ("deferral.store", "deferral.runtime", "deferral.loading")
SEAM = "deferral.store.seam"
# Airflow's ``airflow.models`` shows the tables: ``deferral.models`` re-exports them by name.
TABLES_PATH = "deferral.models"
# Names of the SDK every layer may use: the states, their event kinds and the exceptions.
VOCABULARY = {"deferral.states", "deferral.exceptions"}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _sources(package: str) -> Iterator[tuple[str, Path]]:
    for path in sorted((ROOT / package).rglob("*.py")):
        if path not in ENTRY_POINTS:
            yield _module_name(path), path


def _is_type_checking(node: ast.If) -> bool:
    return "TYPE_CHECKING" in ast.unparse(node.test)


def _literal_import(node: ast.Call) -> str | None:
    """The name ``importlib.import_module("a.b")`` (or ``import_module``) imports, if literal."""
    func = node.func
    name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
    if name != "import_module" or not node.args:
        return None
    first = node.args[0]
    return first.value if isinstance(first, ast.Constant) and isinstance(first.value, str) else None


def imported_names(path: Path, module: str) -> set[str]:
    """Every dotted name ``path`` imports at run time, at any depth (a function's import too),
    leaving out what only type checkers read (``if TYPE_CHECKING:``)."""
    is_package = path.name == "__init__.py"
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".") if is_package else module.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                origin = ".".join([*base, *([node.module] if node.module else [])])
            else:
                origin = node.module or ""
            # ``from a import b`` imports ``a.b`` when b is a module, else ``a``: resolving
            # ``a.b`` to the longest module name finds which (the parent package's own
            # ``__init__`` runs for every import and is not counted).
            found.update(f"{origin}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Call) and (literal := _literal_import(node)):
            found.add(literal)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text(), str(path)))
    return found


def _modules_of(package: str) -> dict[str, Path]:
    return dict(_sources(package))


CORE = _modules_of("deferral")


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The module of ``modules`` that a dotted import name lands in (a name imported from a
    module is that module's)."""
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


def _core_edges() -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {}
    for module, path in CORE.items():
        targets = {_resolve(name, CORE) for name in imported_names(path, module)}
        edges[module] = {t for t in targets if t and t != module}
    return edges


def _is_sdk(module: str) -> bool:
    """The SDK: its packages, and the public modules at the core's root (the inner parts are
    packages at the root too)."""
    if module == "deferral" or module.startswith(SDK_PACKAGES):
        return True
    return module.count(".") == 1 and not module.startswith(INNER_PARTS)


def _top_levels(names: set[str]) -> set[str]:
    return {name.split(".")[0] for name in names}


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_no_package_imports_across_its_layer(package: str) -> None:
    offences = [
        f"{path.relative_to(ROOT)} imports {bad}"
        for module, path in _sources(package)
        for bad in sorted(
            {n.split(".")[0] for n in imported_names(path, module)} & FORBIDDEN[package]
        )
    ]
    assert offences == []


def test_the_broker_imports_nothing_of_the_authoring_sdk() -> None:
    offences = [
        f"{path.relative_to(ROOT)} imports {target}"
        for module, path in _sources("broker")
        for name in sorted(imported_names(path, module))
        if (target := _resolve(name, CORE)) and _is_sdk(target) and target not in VOCABULARY
    ]
    assert offences == []


def test_the_read_model_imports_nothing_of_dag_loading() -> None:
    """What the web UI and the CLI show of DAGs is what the schedulers parsed and stored
    (readmodel/DECISIONS.md 5): the read model never reaches for a DagBag or a parser."""
    offences = [
        f"{path.relative_to(ROOT)} imports {name}"
        for module, path in _sources("readmodel")
        for name in sorted(imported_names(path, module))
        if name == "deferral.loading" or name.startswith("deferral.loading.")
    ]
    assert offences == []


def test_migrations_import_only_the_store() -> None:
    offences = [
        f"{path.relative_to(ROOT)} imports {name}"
        for module, path in _sources("migrations")
        for name in sorted(imported_names(path, module))
        if name.split(".")[0] in PROJECT and not name.startswith("deferral.store.")
    ]
    assert offences == []


def test_the_sdk_reaches_the_store_and_dag_loading_only_through_the_seam() -> None:
    edges = _core_edges()
    offences = [
        f"{module} imports {target}"
        for module in sorted(edges)
        if _is_sdk(module) and module != TABLES_PATH
        for target in sorted(edges[module])
        if target.startswith(("deferral.store", "deferral.loading")) and target != SEAM
    ]
    assert offences == []


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(edges.get(node, ())):
            if target not in index:
                connect(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            connect(node)
    return found


def test_no_module_of_the_core_imports_itself_back() -> None:
    assert _cycles(_core_edges()) == []


def test_the_cycle_check_finds_a_cycle() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_a_literal_import_module_counts_as_an_import(tmp_path: Path) -> None:
    source = tmp_path / "probe.py"
    source.write_text(
        "import importlib\n"
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    import deferral.store.db\n"
        "def late():\n    from deferral.loading import dagbag\n"
        "    return importlib.import_module('deferral.store.tables')\n"
    )
    names = imported_names(source, "probe")
    assert {"deferral.loading.dagbag", "deferral.store.tables"} <= names
    assert "deferral.store.db" not in names


# A service class does one job's worth: a larger one is split by job into modules of its
# package (the scheduler's dispatch, events and housekeeping; the worker's recording; the
# triggerer's starter, runner, publisher, timers, task log store and unwanted sweep), the parts
# every service shares being broker.service's.
MAX_SERVICE_CLASS_LINES = 400


def test_no_service_class_is_over_the_bound() -> None:
    offences = []
    for package in sorted(SERVICES):
        for module, path in _sources(package):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if not isinstance(node, ast.ClassDef) or node.end_lineno is None:
                    continue
                size = node.end_lineno - node.lineno + 1
                if size > MAX_SERVICE_CLASS_LINES:
                    offences.append(f"{module}.{node.name}: {size} lines")
    assert offences == []


# What every service does is written once, in broker/service.py (broker/DECISIONS.md 32): a
# service that writes one of these calls again has a copy of the skeleton.
SKELETON_CALLS = (
    "StreamConsumer(",
    "Quarantine(",
    "liveness.heartbeat(",
    ".exhausted(",
    ".exhausted_reason(",
    "wait_until_up(",
)


def test_the_services_share_one_skeleton() -> None:
    offences = [
        f"{path.relative_to(ROOT)} calls {call}"
        for package in sorted(SERVICES)
        for _, path in _sources(package)
        for call in SKELETON_CALLS
        if call in path.read_text()
    ]
    assert offences == []
