"""The docs site: its Reference is generated from the code (docs/hooks/reference.py) and covers
every command, option, setting and metric, each with help text; the site builds with
``mkdocs build --strict``."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import click
import pytest
from cryptography.fernet import Fernet

from deferral.runtime import config, metrics

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = (
    "deferral",
    "deferral_cli",
    "deferral_healthcheck",
    "broker",
    "scheduler",
    "worker",
    "triggerer",
    "webserver",
)
# DEFERRAL_* names in the code that are not settings: prefixes of Variables, Connections, SMTP
# settings (each listed), a run's ids exported to subprocesses; the tests' fault injection and
# clock offset; a metric's Python name.
NOT_SETTINGS = {
    "CONN_",
    "VAR_",
    "SMTP_",
    "CTX_",
    "TEST_FAULTS",
    "TEST_CLOCK_OFFSET_SEC",
    "TIMEOUTS",
}
BUILD_TIMEOUT_SEC = 300


def _load_reference() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "docs_reference", ROOT / "docs/hooks/reference.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def reference() -> ModuleType:
    return _load_reference()


def test_every_command_option_setting_and_metric_has_help_text(reference: ModuleType) -> None:
    items = list(reference.items())
    assert {item.kind for item in items} == {"command", "option", "setting", "metric"}
    assert [f"{item.kind} {item.name}" for item in items if not item.help.strip()] == []


def test_the_cli_reference_walks_every_command_of_every_console_script(
    reference: ModuleType,
) -> None:
    page = reference.cli_page()
    for script, root in reference.CONSOLE_SCRIPTS.items():
        for path, command in reference.walk_commands(script, root):
            assert f"`{path}`" in page
            for param in command.params:
                if isinstance(param, click.Option) and not param.hidden:
                    assert f"`{', '.join(param.opts + param.secondary_opts)}`" in page, path
    assert "`deferral dags trigger`" in page and "`worker`" in page


def _setting_names_in_code() -> set[str]:
    """Every DEFERRAL_* name the code spells out, and every name config.py reads by its short
    spelling (``get("HEARTBEAT_SEC", ...)``, ``ENV_PREFIX + "X"``, ``f"{ENV_PREFIX}X"``)."""
    names: set[str] = set()
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            names |= set(re.findall(r"\bDEFERRAL_([A-Z0-9_]+)", path.read_text()))
    source = (ROOT / "deferral/runtime/config.py").read_text()
    names |= set(
        re.findall(r'(?:get|_setting\(source,|_one_setting)\(?\s*"([A-Z][A-Z0-9_]+)"', source)
    )
    names |= set(re.findall(r'ENV_PREFIX(?: \+ "|\}\{?)([A-Z][A-Z0-9_]+)', source))
    return names


def test_every_setting_the_code_reads_is_declared_for_the_reference() -> None:
    declared = {setting.name for setting in config.SETTINGS}
    files = {name + config.FILE_SUFFIX for name in config.SECRET_SETTINGS}
    found = _setting_names_in_code() - NOT_SETTINGS - files
    assert "HEARTBEAT_SEC" in found and "WEBSERVER_PORT" in found  # the scan finds settings
    assert sorted(found - declared) == []
    assert set(config.SECRET_SETTINGS) <= declared
    assert len(declared) == len(config.SETTINGS)  # each declared once


def test_the_settings_reference_shows_each_setting_and_its_default(
    reference: ModuleType,
) -> None:
    page = reference.settings_page()
    for setting in config.SETTINGS:
        assert f"`DEFERRAL_{setting.name}`" in page
    assert "| `DEFERRAL_HEARTBEAT_SEC` | `5` |" in page


def test_the_metrics_reference_lists_exactly_what_the_processes_serve(
    reference: ModuleType,
) -> None:
    rows = {row.definition.name: row for row in reference.metric_rows()}
    served = set().union(*(metrics.served_names(process) for process in metrics.PROCESSES))
    assert set(rows) == served
    assert rows["deferral_dead_letters_total"].definition.labels == ("stream",)
    assert rows["deferral_webserver_requests_total"].processes == ("webserver",)
    page = reference.metrics_page()
    assert all(f"`{name}`" in page for name in served)


def test_the_airflow_arguments_reference_lists_every_argument(reference: ModuleType) -> None:
    from deferral.authoring import airflow_arguments

    page = reference.airflow_arguments_page()
    dag_arguments = (*airflow_arguments.DAG_INERT, *airflow_arguments.DAG_DEPRECATED)
    for name in (*airflow_arguments.TASK_ARGUMENTS, *dag_arguments):
        assert f"| `{name}` |" in page


def test_mkdocs_build_strict_succeeds(tmp_path: Path) -> None:
    built = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=BUILD_TIMEOUT_SEC,
        env={"NO_MKDOCS_2_WARNING": "1", "PATH": "/usr/bin:/bin"},
    )
    assert built.returncode == 0, built.stderr
    cli = (tmp_path / "site/reference/cli/index.html").read_text()
    assert "deferral dags trigger" in cli
    started = (tmp_path / "site/getting-started/index.html").read_text()
    # The first DAG's file is included (its class docstring is in no prose of the page).
    assert "Hands its wait to the triggerer" in started


def test_the_readme_links_to_docs_pages_that_exist() -> None:
    links = re.findall(r"\]\((docs/[^)#]+)", (ROOT / "README.md").read_text())
    assert len(links) >= 5
    assert [link for link in links if not (ROOT / link).is_file()] == []


def test_each_declared_default_is_the_one_the_settings_use() -> None:
    """Setting a variable to its documented default changes nothing that is loaded."""
    required = {
        "DEFERRAL_DATABASE_URL": "postgresql+psycopg://u@localhost/db",
        "DEFERRAL_REDIS_URL": "redis://localhost:6379/0",
        "DEFERRAL_FERNET_KEY": Fernet.generate_key().decode(),
    }
    no_file = Path("/nonexistent/deferral.toml")
    loaded = config.load_settings(required, toml_path=no_file)
    web = config.webserver_settings(required)
    checked = 0
    for setting in config.SETTINGS:
        if setting.default is None:
            continue
        given = {**required, config.ENV_PREFIX + setting.name: setting.default}
        assert config.load_settings(given, toml_path=no_file) == loaded, setting.name
        assert config.webserver_settings(given) == web, setting.name
        checked += 1
    assert checked > 20
