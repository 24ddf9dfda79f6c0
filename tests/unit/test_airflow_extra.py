"""The ``airflow`` extra: what Airflow 3 installs that DAG files import, and the import error's
hint when a DAG file imports one of them without it."""

from __future__ import annotations

import re
import tomllib
from importlib.util import find_spec
from pathlib import Path

import pytest

from deferral.loading import airflow_extra
from deferral.loading.dagbag import DagBag

ROOT = Path(__file__).resolve().parents[2]


def test_the_extra_installs_every_library_the_hint_names() -> None:
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    listed = {re.split(r"[<>=!~;\[ ]", spec, maxsplit=1)[0] for spec in extras["airflow"]}
    assert listed == set(airflow_extra.MODULES.values())


@pytest.mark.skipif(find_spec("slugify") is not None, reason="the extra is installed here")
def test_a_dag_file_importing_a_library_airflow_installs_is_told_the_extra(tmp_path: Path) -> None:
    (tmp_path / "uses_slugify.py").write_text(
        "from deferral import DAG\nimport slugify\nwith DAG('x', schedule=None):\n    pass\n"
    )
    (tmp_path / "uses_nothing_known.py").write_text("import no_such_library_anywhere\n")
    bag = DagBag(tmp_path)
    bag.collect()
    errors = {Path(path).name: error for path, error in bag.import_errors.items()}
    assert errors["uses_slugify.py"] == (
        "ModuleNotFoundError: No module named 'slugify' (line 2): Airflow installs "
        "python-slugify; install it with pip install 'deferral[airflow]'"
    )
    assert errors["uses_nothing_known.py"] == (
        "ModuleNotFoundError: No module named 'no_such_library_anywhere' (line 1)"
    )
