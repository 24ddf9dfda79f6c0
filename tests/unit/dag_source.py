"""Loading one DAG file written from source, in a fresh folder, with the import state undone."""

from __future__ import annotations

import sys
import textwrap
import uuid
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest

from deferral.loading.dagbag import DagBag

MODULE_PREFIX = "dag_source_t_"


@pytest.fixture
def isolated_imports(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """DagBag puts its folder on sys.path (and a finder on sys.meta_path) and imports modules:
    undo it all afterwards."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))
    yield
    for name in [n for n in sys.modules if MODULE_PREFIX in n]:
        del sys.modules[name]


def load_source(
    parent: Path, source: str, beside: Mapping[str, str] | None = None
) -> tuple[DagBag, str]:
    """Write ``source`` (dedented; ``{dag_id}`` becomes the module's unique name) as the only
    DAG file of a new folder under ``parent`` (with the files ``beside``: name -> text), and
    load that folder."""
    folder = parent / uuid.uuid4().hex[:8]
    folder.mkdir()
    for file_name, text in (beside or {}).items():
        (folder / file_name).write_text(text)
    name = f"{MODULE_PREFIX}{uuid.uuid4().hex[:10]}"
    text = textwrap.dedent(source)
    (folder / f"{name}.py").write_text(text.replace("{dag_id}", name))
    return DagBag(folder).collect(), name
