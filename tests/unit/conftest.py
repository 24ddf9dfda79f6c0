"""Fixtures of the unit tests."""

from __future__ import annotations

import sys
import textwrap
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from cryptography.fernet import Fernet

from deferral.authoring import templating
from deferral.loading import task_runtime
from deferral.loading.dagbag import process_dagbag
from deferral.store import assets as stored_assets
from worker import attempt


@pytest.fixture
def attempt_dags(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Callable[[str], Path]]:
    """Write a DAG file (under a unique module name) into a DAGs folder that
    worker.attempt.execute_attempt reads in-process; settings point at servers never used."""
    folder = tmp_path / "dags"
    folder.mkdir()
    monkeypatch.chdir(tmp_path)  # no deferral.toml here
    monkeypatch.setattr(sys, "path", list(sys.path))
    # No database here: rendered fields are recorded by the integration tests.
    monkeypatch.setattr(templating, "record_rendered_fields", lambda *args: None)
    # Nor which assets are active (tests/integration/test_asset_uris.py): all are, here.
    monkeypatch.setattr(stored_assets, "inactive_in_store", lambda assets: [])
    env = {
        "DEFERRAL_DATABASE_URL": "postgresql+psycopg://nobody@127.0.0.1:1/never_used",
        "DEFERRAL_REDIS_URL": "redis://127.0.0.1:1/0",
        "DEFERRAL_FERNET_KEY": Fernet.generate_key().decode(),
        "DEFERRAL_DAGS_FOLDER": str(folder),
    }
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    modules: list[str] = []

    def write(source: str) -> Path:
        module = f"attempt_dag_{uuid.uuid4().hex[:12]}"
        modules.append(module)
        (folder / f"{module}.py").write_text(textwrap.dedent(source))
        return folder

    # No database here: the DAG is found by reading the folder.
    monkeypatch.setattr(task_runtime, "parsed_fileloc", lambda dag_id: None)
    process_dagbag.cache_clear()
    attempt._xcoms.cache_clear()
    yield write
    process_dagbag.cache_clear()
    attempt._xcoms.cache_clear()
    for module in modules:
        sys.modules.pop(module, None)
