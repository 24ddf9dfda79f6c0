"""The libraries Apache Airflow 3 installs with itself that DAG files commonly import: a DAG file
moved from Airflow finds them there without asking for them. ``pip install 'deferral[airflow]'``
installs the same set (pyproject.toml's ``airflow`` extra, read from airflow-core's own
dependencies); a DAG file that imports one of them without it is told so in its import error."""

from __future__ import annotations

EXTRA = "deferral[airflow]"

# Import name -> distribution, for each library of the extra (the extra's list in pyproject.toml
# must name every distribution here: tests/unit/test_airflow_extra.py).
MODULES = {
    "attr": "attrs",
    "attrs": "attrs",
    "dateutil": "python-dateutil",
    "dill": "dill",
    "httpx": "httpx",
    "natsort": "natsort",
    "packaging": "packaging",
    "pendulum": "pendulum",
    "psutil": "psutil",
    "pydantic": "pydantic",
    "requests": "requests",
    "rich": "rich",
    "slugify": "python-slugify",
    "structlog": "structlog",
    "tabulate": "tabulate",
    "tenacity": "tenacity",
    "typing_extensions": "typing-extensions",
}


def hint(exc: BaseException) -> str | None:
    """What to say after a DAG file's import error when it is a library Airflow installs."""
    if not isinstance(exc, ModuleNotFoundError) or exc.name is None:
        return None
    top = exc.name.split(".")[0]
    if top not in MODULES:
        return None
    return f"Airflow installs {MODULES[top]}; install it with pip install '{EXTRA}'"
