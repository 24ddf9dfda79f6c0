"""The layout follows the data: ``deferral`` (core) imports neither ``broker`` nor a service nor
the read model, the web UI or the CLI; services import ``deferral`` and ``broker`` but never each
other; ``broker`` imports no service; the read model (what the CLI and the web UI both show)
imports neither of them nor a service; the web UI imports no service and nothing of the CLI.
Checked on the source, so a new import that breaks a layer fails here."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
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
}
# Program entry points, not library code: ``python -m deferral`` runs the command.
ENTRY_POINTS = {ROOT / "deferral" / "__main__.py"}


def _imported_packages(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), str(path))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module.split(".")[0])
    return found


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_no_package_imports_across_its_layer(package: str) -> None:
    offences = [
        f"{path.relative_to(ROOT)} imports {bad}"
        for path in sorted((ROOT / package).rglob("*.py"))
        if path not in ENTRY_POINTS
        for bad in sorted(_imported_packages(path) & FORBIDDEN[package])
    ]
    assert offences == []
