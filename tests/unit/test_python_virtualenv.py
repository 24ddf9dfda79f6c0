"""PythonVirtualenvOperator / ExternalPythonOperator and their TaskFlow decorators, run as a
worker's task process runs them (worker.attempt), in real virtualenvs made from local packages
only: ``requirements=[]`` with the system site packages, or a wheel built here and installed
with ``--no-index``. Nothing is downloaded."""

from __future__ import annotations

import datetime as dt
import functools
import importlib.util
import sys
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from deferral import DAG
from deferral.exceptions import DagDefinitionError
from deferral.operators.python import (
    ExternalPythonOperator,
    PythonVirtualenvOperator,
    is_venv_installed,
)
from deferral.utils.python_virtualenv import MARKER, function_source
from tests.helpers import process_alive, wait_for
from tests.unit.test_attempt_authoring import MemoryXComs
from worker import attempt
from worker.attempt import execute_attempt
from worker.outcomes import AttemptRequest, Failed, Skipped, Succeeded

LOGICAL = dt.datetime(2024, 2, 3, 4, 5, tzinfo=dt.UTC)

# Written as Airflow's example_python_operator.py writes its virtualenv tasks.
DAG_SOURCE = """
import datetime as dt
import sys

from deferral import DAG, task
from deferral.operators.python import ExternalPythonOperator, PythonVirtualenvOperator
from deferral.operators.empty import EmptyOperator

PATH_TO_PYTHON_BINARY = sys.executable
FROM_THE_LOCAL_WHEEL = {{
    "pip_install_options": ["--no-index", "--find-links", {wheels!r}],
    "venv_cache_path": {cache!r},
}}


def callable_virtualenv(greeting, ds, logical_date, params, count=1):
    import sys

    print(f"{{greeting}} from {{sys.prefix}}")
    try:
        import deferral  # noqa: F401
        seen = "deferral importable"
    except ImportError:
        seen = "deferral not importable"
    return {{
        "greeting": greeting * count,
        "ds": ds,
        "logical_date": logical_date.isoformat(),
        "params": params,
        "prefix": sys.prefix,
        "seen": seen,
        "string_args": virtualenv_string_args,
    }}


def uses_the_local_wheel():
    import tinypkg

    return tinypkg.answer()


def environment():
    import os

    return dict(os.environ)


def breaks():
    raise ValueError("the virtualenv task broke")


def exits(code):
    import sys

    sys.exit(code)


def wants_ti(ti):
    return ti


def sleeps(pid_file):
    import os
    import time

    with open(pid_file, "w") as file:
        file.write(str(os.getpid()))
    time.sleep(300)


def returns_a_script_class():
    import collections

    point = collections.namedtuple("Point", "x")  # a class of the script's own __main__
    globals()["Point"] = point
    return point(1)


with DAG("venv_dag", params={{"size": 3}}) as dag:
    PythonVirtualenvOperator(
        task_id="virtualenv_python",
        python_callable=callable_virtualenv,
        requirements=[],
        system_site_packages=True,
        op_args=["hi"],
        op_kwargs={{"count": 2}},
        string_args=["one", "two"],
    )
    PythonVirtualenvOperator(
        task_id="templated",
        python_callable=callable_virtualenv,
        op_kwargs={{"greeting": "{{{{ ds_nodash }}}}-"}},
        requirements=[],
    )
    PythonVirtualenvOperator(
        task_id="local_wheel",
        python_callable=uses_the_local_wheel,
        requirements=["tinypkg==1.0"],
        system_site_packages=False,
        **FROM_THE_LOCAL_WHEEL,
    )
    PythonVirtualenvOperator(
        task_id="requirements_file",
        python_callable=uses_the_local_wheel,
        requirements="venv_requirements.txt",
        system_site_packages=False,
        **FROM_THE_LOCAL_WHEEL,
    )
    PythonVirtualenvOperator(
        task_id="missing_requirement",
        python_callable=uses_the_local_wheel,
        requirements=["tinypkg==2.0"],
        **FROM_THE_LOCAL_WHEEL,
    )
    PythonVirtualenvOperator(
        task_id="own_environment",
        python_callable=environment,
        inherit_env=False,
        env_vars={{"GREETING": "hola"}},
    )
    ExternalPythonOperator(
        task_id="external_python",
        python=PATH_TO_PYTHON_BINARY,
        python_callable=callable_virtualenv,
        op_args=["ext"],
    )
    PythonVirtualenvOperator(task_id="breaks", python_callable=breaks, requirements=[])
    PythonVirtualenvOperator(
        task_id="skips", python_callable=exits, op_args=[7], skip_on_exit_code=[7]
    )
    PythonVirtualenvOperator(task_id="exits", python_callable=exits, op_args=[3])
    PythonVirtualenvOperator(task_id="old_python", python_callable=breaks, python_version="2.7")
    PythonVirtualenvOperator(task_id="wants_ti", python_callable=wants_ti)
    PythonVirtualenvOperator(task_id="local_class", python_callable=returns_a_script_class)
    PythonVirtualenvOperator(
        task_id="too_long",
        python_callable=sleeps,
        op_args=[{pid_file!r}],
        # The virtualenv (no requirements: made without pip, about 0.1 s) is made within it.
        execution_timeout=dt.timedelta(seconds=3),
    )
    ExternalPythonOperator(
        task_id="no_such_python", python="/nonexistent/bin/python", python_callable=breaks
    )

    @task.virtualenv(task_id="taskflow_virtualenv", requirements=[], multiple_outputs=True)
    def taskflow_virtualenv(value):
        import json

        return {{"doubled": value * 2, "json": json.dumps([value])}}

    @task.external_python(task_id="taskflow_external", python=PATH_TO_PYTHON_BINARY)
    def taskflow_external(value):
        return value + 1

    taskflow_virtualenv(21)
    taskflow_external(41)

    @task.branch_virtualenv(task_id="branch_virtualenv", requirements=[])
    def choose():
        return "left"

    choose() >> [EmptyOperator(task_id="left"), EmptyOperator(task_id="right")]
"""


def build_wheel(folder: Path) -> Path:
    """A pure-Python wheel of ``tinypkg`` 1.0 (``tinypkg.answer() == 42``), written by hand: no
    build backend is needed, and none is downloaded."""
    folder.mkdir()
    path = folder / "tinypkg-1.0-py3-none-any.whl"
    info = "tinypkg-1.0.dist-info"
    with zipfile.ZipFile(path, "w") as wheel:
        wheel.writestr("tinypkg/__init__.py", "def answer():\n    return 42\n")
        wheel.writestr(f"{info}/METADATA", "Metadata-Version: 2.1\nName: tinypkg\nVersion: 1.0\n")
        wheel.writestr(
            f"{info}/WHEEL",
            "Wheel-Version: 1.0\nGenerator: tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
        )
        wheel.writestr(
            f"{info}/RECORD",
            f"tinypkg/__init__.py,,\n{info}/METADATA,,\n{info}/WHEEL,,\n{info}/RECORD,,\n",
        )
    return folder


@pytest.fixture
def paths(attempt_dags: Callable[[str], Path], tmp_path: Path) -> dict[str, Path]:
    wheels = build_wheel(tmp_path / "wheels")
    cache = tmp_path / "venv-cache"
    pid_file = tmp_path / "function.pid"
    folder = attempt_dags(
        DAG_SOURCE.format(wheels=str(wheels), cache=str(cache), pid_file=str(pid_file))
    )
    (folder / "venv_requirements.txt").write_text("# what the report needs\ntinypkg==1.0\n\n")
    return {"wheels": wheels, "cache": cache, "pid_file": pid_file}


@pytest.fixture(autouse=True)
def xcoms(monkeypatch: pytest.MonkeyPatch) -> MemoryXComs:
    memory = MemoryXComs()
    monkeypatch.setattr(attempt, "_xcoms", functools.cache(lambda: memory))
    return memory


def run(task_id: str) -> Any:
    return execute_attempt(
        AttemptRequest(
            task_instance_id=7,
            dag_id="venv_dag",
            run_id="manual__1",
            task_id=task_id,
            map_index=-1,
            try_number=1,
            logical_date=LOGICAL,
            conf={},
            first_started_at=dt.datetime.now(dt.UTC),
            next_method=None,
            next_kwargs=None,
            max_tries=0,
        )
    )


def test_venv_is_installed() -> None:
    assert is_venv_installed()


def test_the_function_runs_in_a_virtualenv_of_its_own(
    paths: dict[str, Path], capfd: pytest.CaptureFixture[str]
) -> None:
    outcome = run("virtualenv_python")
    assert isinstance(outcome, Succeeded), outcome
    value = outcome.return_value
    assert value["prefix"] != sys.prefix
    # The system site packages, not the worker's environment: deferral is not there.
    assert value["seen"] == "deferral not importable"
    assert (value["greeting"], value["ds"]) == ("hihi", "2024-02-03")
    assert value["logical_date"] == "2024-02-03T04:05:00+00:00"
    assert value["params"] == {"size": 3}
    assert value["string_args"] == ["one", "two"]
    assert f"hi from {value['prefix']}" in capfd.readouterr().out  # the task's log
    assert not Path(value["prefix"]).exists()  # made for the attempt, then removed


def test_the_functions_environment(paths: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """inherit_env=False: only env_vars and the run's ids; the virtualenv is still made in the
    worker's environment (pip's settings there apply)."""
    monkeypatch.setenv("WORKER_ONLY", "1")
    outcome = run("own_environment")
    assert isinstance(outcome, Succeeded), outcome
    seen = outcome.return_value
    assert seen["GREETING"] == "hola"
    assert (seen["DEFERRAL_CTX_DAG_ID"], seen["AIRFLOW_CTX_TASK_ID"]) == (
        "venv_dag",
        "own_environment",
    )
    assert "WORKER_ONLY" not in seen and "PATH" not in seen


def test_op_kwargs_are_rendered_before_they_travel(paths: dict[str, Path]) -> None:
    outcome = run("templated")
    assert isinstance(outcome, Succeeded), outcome
    assert outcome.return_value["greeting"] == "20240203-"


def test_requirements_from_a_local_wheel_and_the_cache(
    paths: dict[str, Path], capfd: pytest.CaptureFixture[str]
) -> None:
    assert run("local_wheel") == Succeeded(42)
    made = [p for p in paths["cache"].iterdir() if p.is_dir()]
    assert len(made) == 1 and (made[0] / MARKER).is_file()
    assert "made the cached virtualenv" in capfd.readouterr().out
    assert run("local_wheel") == Succeeded(42)
    assert f"reusing the cached virtualenv {made[0]}" in capfd.readouterr().out
    # A requirements file (a template file beside the DAG) listing the same: the same one.
    assert run("requirements_file") == Succeeded(42)
    assert f"reusing the cached virtualenv {made[0]}" in capfd.readouterr().out


def test_a_failed_install_leaves_no_cached_virtualenv(paths: dict[str, Path]) -> None:
    outcome = run("missing_requirement")
    assert isinstance(outcome, Failed), outcome
    assert outcome.error.startswith(
        "VirtualenvError: installing the requirements failed with exit code 1: ERROR: No matching"
    ), outcome.error
    assert [p for p in paths["cache"].iterdir() if p.is_dir()] == []


def test_external_python_and_taskflow_decorators(
    paths: dict[str, Path], xcoms: MemoryXComs
) -> None:
    outcome = run("external_python")
    assert isinstance(outcome, Succeeded), outcome
    assert outcome.return_value["prefix"] == sys.prefix
    assert outcome.return_value["seen"] == "deferral importable"
    assert run("taskflow_external") == Succeeded(42)
    assert run("taskflow_virtualenv") == Succeeded({"doubled": 42, "json": "[21]"})
    assert xcoms.values[("7", "doubled")] == 42  # multiple_outputs
    outcome = run("branch_virtualenv")
    assert isinstance(outcome, Succeeded) and outcome.skip_task_ids == ("right",)


@pytest.mark.parametrize(
    ("task_id", "error"),
    [
        (
            "breaks",
            "VirtualenvError: python_callable failed in the virtualenv (exit code 1):"
            " ValueError: the virtualenv task broke",
        ),
        ("exits", "VirtualenvError: python_callable failed in the virtualenv (exit code 3)"),
        ("old_python", "VirtualenvError: python_version '2.7': no python2.7 on this worker"),
        ("wants_ti", "VirtualenvError: python_callable takes 'ti', a context entry that cannot"),
        ("local_class", "VirtualenvError: the return value of python_callable cannot be read"),
        ("no_such_python", "VirtualenvError: python '/nonexistent/bin/python' is not an exec"),
    ],
)
def test_failures_name_their_cause(paths: dict[str, Path], task_id: str, error: str) -> None:
    outcome = run(task_id)
    assert isinstance(outcome, Failed), outcome
    assert outcome.error.startswith(error), outcome.error


def test_execution_timeout_stops_the_function(paths: dict[str, Path]) -> None:
    outcome = run("too_long")
    assert isinstance(outcome, Failed), outcome
    assert outcome.error.startswith("TaskExecutionTimeout: execution_timeout passed")
    pid = int(paths["pid_file"].read_text())
    wait_for(lambda: not process_alive(pid), timeout=30, what="the function's process to end")


def test_skip_on_exit_code(paths: dict[str, Path]) -> None:
    assert run("skips") == Skipped(
        "SkipTask: python_callable exited with code 7 (skip_on_exit_code)"
    )


def _plain() -> int:
    return 1


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"python_callable": lambda: 1}, "python_callable must be a function defined with def"),
        ({"python_callable": _plain, "serializer": "json"}, "serializer must be one of pickle"),
        ({"python_callable": _plain, "serializer": "cloudpickle"}, "needs the cloudpickle package"),
        ({"python_callable": _plain, "python_version": 3.11}, "python_version must be a string"),
        ({"python_callable": _plain, "use_airflow_context": True}, "use_airflow_context=True"),
        ({"python_callable": _plain, "env_vars": {"A": 1}}, "env_vars must be a dict of str"),
        ({"python_callable": _plain, "skip_on_exit_code": "1"}, "skip_on_exit_code must be"),
    ],
)
def test_bad_arguments_are_refused_at_load(kwargs: dict[str, Any], error: str) -> None:
    if kwargs.get("serializer") == "cloudpickle" and importlib.util.find_spec("cloudpickle"):
        pytest.skip("cloudpickle is installed here")
    with DAG("bad"), pytest.raises(DagDefinitionError, match=error):
        PythonVirtualenvOperator(task_id="t", **kwargs)


def test_external_python_needs_a_python() -> None:
    with DAG("bad"), pytest.raises(DagDefinitionError, match="python must be the path"):
        ExternalPythonOperator(task_id="t", python="", python_callable=_plain)


def test_the_script_defines_the_bare_function() -> None:
    def decorator(function: Callable[..., Any]) -> Callable[..., Any]:
        return function

    @decorator
    def nested(x: int) -> int:
        return x

    assert function_source(nested) == "def nested(x: int) -> int:\n    return x\n"
