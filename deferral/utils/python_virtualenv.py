"""Virtualenvs for PythonVirtualenvOperator / ExternalPythonOperator, as Airflow's
``airflow.utils.python_virtualenv``: which Python makes them, how they are made (``python -m
venv``, then ``pip install``), a cache of them keyed by what they hold, and the script that runs
a task's function in one.

Commands run through a ``RunCommand`` the operator hands in, so that their output goes to the
task's log and an execution_timeout stops them.
"""

from __future__ import annotations

import ast
import fcntl
import hashlib
import importlib.util
import inspect
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from deferral.exceptions import DeferralException

# Runs a command to its end: (exit code, last line of its output).
RunCommand = Callable[[list[str]], tuple[int, str]]

SERIALIZERS = ("pickle", "cloudpickle", "dill")
_VERSION = re.compile(r"\d+(\.\d+)?")
# A cached virtualenv is complete once this file holds its spec.
MARKER = "deferral-venv.json"


class VirtualenvError(DeferralException):
    """A virtualenv could not be made or used; the message says which and why."""


def serializer_error(serializer: Any) -> str | None:
    """Why ``serializer`` cannot carry a virtualenv task's arguments and return value here (an
    unknown name, or its package missing from the worker's environment), or None."""
    if serializer not in SERIALIZERS:
        return f"serializer must be one of {', '.join(SERIALIZERS)}, got {serializer!r}"
    if importlib.util.find_spec(serializer) is None:
        return (
            f"serializer={serializer!r} needs the {serializer} package, which is not installed"
            " beside deferral (pickle always is)"
        )
    return None


def python_version_error(python_version: Any) -> str | None:
    """Why ``python_version`` is malformed (Airflow's spelling: ``"3"`` or ``"3.11"``), or None."""
    if python_version is None:
        return None
    if not isinstance(python_version, str) or not _VERSION.fullmatch(python_version):
        return f"python_version must be a string such as '3.11', got {python_version!r}"
    return None


def installed_pythons() -> list[str]:
    """The ``python3.N`` interpreters on PATH, and this one."""
    found = {f"{sys.version_info.major}.{sys.version_info.minor}"}
    for folder in os.environ.get("PATH", "").split(os.pathsep):
        with_names = Path(folder).glob("python[0-9].*[0-9]") if Path(folder).is_dir() else []
        found |= {p.name.removeprefix("python") for p in with_names if os.access(p, os.X_OK)}
    return sorted(found, key=lambda v: tuple(int(n) for n in v.split(".") if n.isdigit()))


def find_python(python_version: str | None) -> str:
    """The interpreter that makes a virtualenv of ``python_version``: this one when it is that
    version (or none is asked for), else ``python<version>`` on PATH."""
    running = (str(sys.version_info.major), f"{sys.version_info.major}.{sys.version_info.minor}")
    if python_version is None or python_version in running:
        return sys.executable
    found = shutil.which(f"python{python_version}")
    version = None if found is None else _version_of(found)
    if found is None or version is None or not f"{version}.".startswith(f"{python_version}."):
        raise VirtualenvError(
            f"python_version {python_version!r}: no python{python_version} on this worker"
            f" (installed: {', '.join(installed_pythons())})"
        )
    return found


def _version_of(python: str) -> str | None:
    """``major.minor`` of the interpreter ``python``; None if it does not run (a pyenv shim of
    a version not selected, say)."""
    try:
        answer = subprocess.run(
            [python, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return answer.stdout.strip() if answer.returncode == 0 else None


@dataclass(frozen=True)
class VirtualenvSpec:
    """What a virtualenv holds: what makes it (and names its cache folder)."""

    python: str
    system_site_packages: bool
    requirements: tuple[str, ...]
    pip_install_options: tuple[str, ...] = ()
    index_urls: tuple[str, ...] = ()

    def key(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)


def requirement_lines(requirements: Iterable[str]) -> tuple[str, ...]:
    """Requirement strings, one per line (a rendered requirements file gives many), without
    blank and comment lines, sorted: the same set is the same virtualenv."""
    lines = (line.strip() for text in requirements for line in str(text).splitlines())
    return tuple(sorted({line for line in lines if line and not line.startswith("#")}))


def prepare_virtualenv(directory: Path, spec: VirtualenvSpec, run: RunCommand) -> Path:
    """Make a virtualenv of ``spec`` in ``directory``; its python. pip is bootstrapped from the
    interpreter's own copy (ensurepip) only when there is something to install."""
    argv = [spec.python, "-m", "venv"]
    if spec.system_site_packages:
        argv.append("--system-site-packages")
    if not spec.requirements:
        argv.append("--without-pip")
    _check(run([*argv, str(directory)]), f"making the virtualenv {directory}")
    python = directory / "bin" / "python"
    if spec.requirements:
        listed = directory / "requirements.txt"
        listed.write_text("".join(f"{line}\n" for line in spec.requirements))
        pip = [str(python), "-m", "pip", "install", "--disable-pip-version-check", "--no-input"]
        indexes: list[str] = []
        for position, url in enumerate(spec.index_urls):
            indexes += ["--index-url" if position == 0 else "--extra-index-url", url]
        argv = [*pip, "-r", str(listed), *spec.pip_install_options, *indexes]
        _check(run(argv), "installing the requirements")
    return python


def _check(result: tuple[int, str], doing: str) -> None:
    exit_code, last_line = result
    if exit_code != 0:
        raise VirtualenvError(f"{doing} failed with exit code {exit_code}: {last_line}")


def cached_virtualenv(cache: Path, spec: VirtualenvSpec, run: RunCommand) -> Path:
    """The python of the virtualenv of ``spec`` under ``cache`` (``venv-<hash of spec>``), made
    first if it is missing or incomplete. One process makes it while others on the host wait
    (a lock file beside it); a failed attempt leaves nothing behind."""
    digest = hashlib.sha256(spec.key().encode()).hexdigest()[:16]
    directory = cache / f"venv-{digest}"
    cache.mkdir(parents=True, exist_ok=True)
    with open(f"{directory}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        marker = directory / MARKER
        if marker.is_file() and marker.read_text() == spec.key():
            print(f"reusing the cached virtualenv {directory}", flush=True)
            return directory / "bin" / "python"
        if directory.exists():
            print(f"remaking the incomplete cached virtualenv {directory}", flush=True)
            shutil.rmtree(directory)
        try:
            python = prepare_virtualenv(directory, spec, run)
            marker.write_text(spec.key())
        except BaseException:
            shutil.rmtree(directory, ignore_errors=True)
            raise
        print(f"made the cached virtualenv {directory}", flush=True)
        return python


def function_source(function: Callable[..., Any]) -> str:
    """The source of ``function``'s ``def``, dedented, without its decorators (``@task.virtualenv``
    and its arguments): the script defines the bare function."""
    try:
        source = textwrap.dedent(inspect.getsource(function))
    except (OSError, TypeError) as exc:
        raise VirtualenvError(
            f"the source of {function.__qualname__} is not readable: {exc}"
        ) from None
    definition = next(
        node
        for node in ast.parse(source).body
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
    )
    return "\n".join(source.splitlines()[definition.lineno - 1 :]) + "\n"


# The script a virtualenv runs: argv[1] holds the arguments (absent or empty: none), argv[2]
# receives the return value, argv[3] the lines of ``virtualenv_string_args`` (Airflow's global).
_SCRIPT = """\
import sys

import {serializer} as _serializer

with open(sys.argv[3]) as _lines:
    virtualenv_string_args = _lines.read().splitlines()

{source}

def _deferral_main():
    _call = {{"args": [], "kwargs": {{}}}}
    try:
        with open(sys.argv[1], "rb") as _file:
            _call = _serializer.load(_file)
    except (FileNotFoundError, EOFError):
        pass
    _result = {name}(*_call["args"], **_call["kwargs"])
    with open(sys.argv[2], "wb") as _file:
        _serializer.dump(_result, _file)


if __name__ == "__main__":
    _deferral_main()
"""


def write_script(path: Path, function: Callable[..., Any], serializer: str) -> None:
    path.write_text(
        _SCRIPT.format(
            serializer=serializer, source=function_source(function), name=function.__name__
        )
    )


def script_argv(python: str, folder: Path) -> list[str]:
    """The command running the script written in ``folder``, with its files there."""
    names: Sequence[str] = ("script.py", "script.in", "script.out", "string_args.txt")
    return [python, *(str(folder / name) for name in names)]
