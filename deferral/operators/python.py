"""PythonOperator and its relatives that decide what runs next: BranchPythonOperator and
ShortCircuitOperator."""

from __future__ import annotations

import asyncio
import datetime as dt
import importlib
import importlib.util
import inspect
import os
import subprocess
import tempfile
import types
from abc import abstractmethod
from collections.abc import Callable, Container, Iterable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Any

from deferral.assets import collect_metadata
from deferral.baseoperator import BaseOperator
from deferral.context import Context, get_current_context
from deferral.exceptions import DagDefinitionError, SkipTask
from deferral.operators.bash import context_environment, run_process, skip_codes, stop_process_group
from deferral.operators.branch import branch_skips
from deferral.runtime.config import venv_cache_path
from deferral.utils.python_virtualenv import (
    VirtualenvError,
    VirtualenvSpec,
    cached_virtualenv,
    find_python,
    function_source,
    prepare_virtualenv,
    python_version_error,
    requirement_lines,
    script_argv,
    serializer_error,
    write_script,
)

__all__ = [
    "BranchExternalPythonOperator",
    "BranchPythonOperator",
    "BranchPythonVirtualenvOperator",
    "ExternalPythonOperator",
    "PythonOperator",
    "PythonVirtualenvOperator",
    "ShortCircuitOperator",
    "call_with_context",
    "get_current_context",
    "is_venv_installed",
]


class PythonCallableMixin:
    """The arguments of a task that calls ``python_callable`` (PythonOperator, PythonSensor):
    ``op_args``, ``op_kwargs`` and ``templates_dict``, templated; the rendered ``templates_dict``
    reaches the callable as its ``templates_dict`` argument."""

    template_fields: Sequence[str] = ("templates_dict", "op_args", "op_kwargs")
    template_ext: Sequence[str] = ()
    task_id: str

    def __init__(
        self,
        *,
        python_callable: Callable[..., Any],
        op_args: Sequence[Any] | None = None,
        op_kwargs: Mapping[str, Any] | None = None,
        templates_dict: dict[str, Any] | None = None,
        templates_exts: Sequence[str] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        if not callable(python_callable):
            raise DagDefinitionError(f"task {self.task_id!r}: python_callable is not callable")
        if templates_exts is not None:
            # Airflow's name: the endings of values (in templates_dict ...) that name a
            # template file rather than hold a template.
            if isinstance(templates_exts, str) or not all(
                isinstance(ext, str) for ext in templates_exts
            ):
                raise DagDefinitionError(
                    f"task {self.task_id!r}: templates_exts must be a list of str"
                )
            self.template_ext = tuple(templates_exts)
        self.python_callable = python_callable
        self.op_args = list(op_args or [])
        self.op_kwargs = dict(op_kwargs or {})
        self.templates_dict = templates_dict

    def call_python_callable(self, context: Context) -> Any:
        available = {**context, "templates_dict": self.templates_dict}
        return call_with_context(self.python_callable, self.op_args, self.op_kwargs, available)


class PythonOperator(PythonCallableMixin, BaseOperator):
    """Calls ``python_callable(*op_args, **op_kwargs)``, adding the context entries its signature
    names (or all of them if it takes ``**kwargs``)."""

    def execute(self, context: Context) -> Any:
        if inspect.isgeneratorfunction(self.python_callable):  # it yields Metadata
            return collect_metadata(self.call_python_callable(context), context["outlet_events"])
        if inspect.iscoroutinefunction(self.python_callable):  # Airflow 3.1's async tasks
            return asyncio.run(self.call_python_callable(context))
        return self.call_python_callable(context)


def call_with_context(
    function: Callable[..., Any],
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
    context: Mapping[str, Any],
) -> Any:
    """``function(*args, **kwargs)`` plus the context entries its signature names (all of them
    if it takes ``**kwargs``) that no argument already gives."""
    return function(*args, **kwargs, **context_arguments(function, args, kwargs, context))


def context_arguments(
    function: Callable[..., Any],
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
    context: Mapping[str, Any],
) -> dict[str, Any]:
    """The entries of ``context`` that ``function``'s signature names (all of them if it takes
    ``**kwargs``) and that neither ``args`` nor ``kwargs`` give."""
    try:
        parameters = inspect.signature(function).parameters
    except (TypeError, ValueError):  # builtins such as print have no signature
        return {}
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        wanted = set(context)
    else:
        wanted = set(parameters) & set(context)
    given = set(kwargs) | set(_positional_names(parameters.values(), args))
    return {k: v for k, v in context.items() if k in wanted and k not in given}


def _positional_names(parameters: Iterable[inspect.Parameter], args: Sequence[Any]) -> list[str]:
    """The names of the parameters ``args`` fill."""
    positional = (
        p.name
        for p in parameters
        if p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    )
    return [name for name, _ in zip(positional, args, strict=False)]


class BranchPythonOperator(PythonOperator):
    """The callable returns the task id (or task group id) to follow, a list of them, or None;
    every task directly downstream that is not followed is skipped, and trigger rules carry the
    skip further (a join after the branch wants ``none_failed_min_one_success``)."""

    def execute(self, context: Context) -> Any:
        chosen = super().execute(context)
        context["ti"].skip_task_ids.update(branch_skips(self, chosen))
        return chosen


class ShortCircuitOperator(PythonOperator):
    """A falsy result skips what follows: with ``ignore_downstream_trigger_rules`` (the default)
    every task downstream, whatever its trigger rule; without, only the tasks directly
    downstream, and their own downstream tasks follow their trigger rules."""

    def __init__(self, *, ignore_downstream_trigger_rules: bool = True, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.ignore_downstream_trigger_rules = ignore_downstream_trigger_rules

    def execute(self, context: Context) -> Any:
        condition = super().execute(context)
        if not condition:
            context["ti"].skip_task_ids.update(self.short_circuit_skips())
        return condition

    def short_circuit_skips(self) -> set[str]:
        if self.ignore_downstream_trigger_rules and self.dag is not None:
            return self.dag.downstream_of(self.task_id)
        return set(self.downstream_task_ids)


def is_venv_installed() -> bool:
    """Whether PythonVirtualenvOperator can make virtualenvs here: the standard library's
    ``venv`` is present (Airflow asks for ``virtualenv`` or ``uv``)."""
    return importlib.util.find_spec("venv") is not None


# What a function run in a virtualenv may take from the context: plain values, which the
# virtualenv can read without deferral (Airflow passes the same names). Date-times are the
# standard library's, in UTC; ``params`` is a plain dict.
VIRTUALENV_CONTEXT_TEXT = frozenset(
    {
        "ds",
        "ds_nodash",
        "ts",
        "ts_nodash",
        "ts_nodash_with_tz",
        "run_id",
        "task_instance_key_str",
        "next_ds",
        "next_ds_nodash",
        "prev_ds",
        "prev_ds_nodash",
        "yesterday_ds",
        "yesterday_ds_nodash",
        "tomorrow_ds",
        "tomorrow_ds_nodash",
        "try_number",
    }
)
VIRTUALENV_CONTEXT_DATETIMES = frozenset(
    {
        "logical_date",
        "execution_date",
        "data_interval_start",
        "data_interval_end",
        "next_execution_date",
        "prev_execution_date",
    }
)


def virtualenv_context(context: Mapping[str, Any]) -> dict[str, Any]:
    """The entries of ``context`` a function in a virtualenv may take, as plain values."""
    plain: dict[str, Any] = {}
    for key, value in context.items():
        if key in VIRTUALENV_CONTEXT_TEXT:
            plain[key] = value
        elif key in VIRTUALENV_CONTEXT_DATETIMES and isinstance(value, dt.datetime):
            plain[key] = dt.datetime.fromtimestamp(value.timestamp(), dt.UTC)
        elif key == "params":
            plain[key] = dict(value)
    return plain


class _BaseVirtualenvOperator(PythonOperator):
    """Runs ``python_callable`` in another Python, as Airflow does: its source (without
    decorators) is written to a script, its arguments and return value travel through files in
    ``serializer``'s format, and its output goes to the task's log. The function must import
    what it uses inside its body; the context entries it may take are plain values
    (``virtualenv_context``). An exit code in ``skip_on_exit_code`` skips the task."""

    def __init__(
        self,
        *,
        python_callable: Callable[..., Any],
        serializer: str | None = None,
        op_args: Sequence[Any] | None = None,
        op_kwargs: Mapping[str, Any] | None = None,
        string_args: Iterable[str] | None = None,
        templates_dict: dict[str, Any] | None = None,
        templates_exts: Sequence[str] | None = None,
        expect_airflow: bool = True,
        skip_on_exit_code: int | Container[int] | None = None,
        env_vars: dict[str, str] | None = None,
        inherit_env: bool = True,
        use_dill: bool = False,
        use_airflow_context: bool = False,
        **kwargs: Any,
    ) -> None:
        super().__init__(
            python_callable=python_callable,
            op_args=op_args,
            op_kwargs=op_kwargs,
            templates_dict=templates_dict,
            templates_exts=templates_exts,
            **kwargs,
        )
        where = f"task {self.task_id!r}"
        if not isinstance(python_callable, types.FunctionType) or (
            python_callable.__name__ == "<lambda>"
        ):
            raise DagDefinitionError(
                f"{where}: python_callable must be a function defined with def"
            )
        if inspect.isgeneratorfunction(python_callable):
            raise DagDefinitionError(f"{where}: python_callable must not yield")
        try:
            function_source(python_callable)  # what the virtualenv will run
        except VirtualenvError as exc:
            raise DagDefinitionError(f"{where}: {exc}") from None
        if use_airflow_context:
            raise DagDefinitionError(
                f"{where}: use_airflow_context=True is not supported by deferral (it needs Airflow"
                " in the virtualenv): take context values as arguments (ds, logical_date ...)"
            )
        serializer = serializer or ("dill" if use_dill else "pickle")
        error = serializer_error(serializer)
        if error:
            raise DagDefinitionError(f"{where}: {error}")
        if env_vars is not None and not (
            isinstance(env_vars, dict)
            and all(isinstance(k, str) and isinstance(v, str) for k, v in env_vars.items())
        ):
            raise DagDefinitionError(f"{where}: env_vars must be a dict of str to str")
        self.serializer = serializer
        self.string_args = list(string_args or [])
        self.expect_airflow = expect_airflow  # Airflow loads its macros in the virtualenv
        self.skip_on_exit_code = skip_codes(where, skip_on_exit_code)
        self.env_vars = env_vars
        self.inherit_env = inherit_env
        self._process: subprocess.Popen[bytes] | None = None

    @abstractmethod
    def virtualenv_python(self) -> AbstractContextManager[str]:
        """The python to run the function with, for as long as the attempt uses it."""

    def execute(self, context: Context) -> Any:
        kwargs = self._call_kwargs(context)
        with (
            self.virtualenv_python() as python,
            tempfile.TemporaryDirectory(prefix="deferral-venv-call-") as scratch,
        ):
            folder = Path(scratch)
            write_script(folder / "script.py", self.python_callable, self.serializer)
            (folder / "string_args.txt").write_text("\n".join(map(str, self.string_args)))
            if self.op_args or kwargs:
                (folder / "script.in").write_bytes(
                    self._serializer().dumps({"args": list(self.op_args), "kwargs": kwargs})
                )
            exit_code, last_line = self.run_command(
                script_argv(python, folder), self.function_environment(context)
            )
            if exit_code in self.skip_on_exit_code:
                raise SkipTask(f"python_callable exited with code {exit_code} (skip_on_exit_code)")
            if exit_code != 0:
                said = f": {last_line}" if last_line else ""
                raise VirtualenvError(
                    f"python_callable failed in the virtualenv (exit code {exit_code}){said}"
                )
            return self._read_result(folder / "script.out")

    def run_command(self, argv: list[str], env: Mapping[str, str] | None = None) -> tuple[int, str]:
        """Run ``argv`` with its output in the task's log, stopped with the task: in the
        worker's environment (making the virtualenv: pip's own settings apply), or ``env``."""

        def started(process: subprocess.Popen[bytes] | None) -> None:
            self._process = process  # what on_kill stops

        environment = dict(os.environ if env is None else env)
        with tempfile.TemporaryDirectory(prefix="deferral-venv-cwd-") as cwd:
            return run_process(argv, cwd, environment, "utf-8", started)

    def function_environment(self, context: Context) -> dict[str, str]:
        """The function's environment: the worker's unless ``inherit_env=False``, ``env_vars``,
        and the run's ``DEFERRAL_CTX_*`` / ``AIRFLOW_CTX_*``."""
        env = dict(os.environ) if self.inherit_env else {}
        env.update(self.env_vars or {})
        env.update(context_environment(context))
        return env

    def on_kill(self) -> None:
        if self._process is not None:
            stop_process_group(self._process)

    def _call_kwargs(self, context: Context) -> dict[str, Any]:
        """``op_kwargs``, ``templates_dict`` (if set, as Airflow passes it) and the plain
        context values the function names; a parameter naming another context entry, which
        cannot travel, is refused by name."""
        plain = virtualenv_context(context)
        kwargs = dict(self.op_kwargs)
        if self.templates_dict:
            kwargs["templates_dict"] = self.templates_dict
        kwargs.update(context_arguments(self.python_callable, self.op_args, kwargs, plain))
        parameters = inspect.signature(self.python_callable).parameters.values()
        filled = set(kwargs) | set(_positional_names(parameters, self.op_args))
        for parameter in parameters:
            required = parameter.default is inspect.Parameter.empty
            if required and parameter.name in context and parameter.name not in filled:
                raise VirtualenvError(
                    f"python_callable takes {parameter.name!r}, a context entry that cannot"
                    " reach a virtualenv; it may take "
                    + ", ".join(sorted(VIRTUALENV_CONTEXT_TEXT | VIRTUALENV_CONTEXT_DATETIMES))
                    + ", params"
                )
        return kwargs

    def _serializer(self) -> Any:
        return importlib.import_module(self.serializer)

    def _read_result(self, path: Path) -> Any:
        if not path.exists() or path.stat().st_size == 0:
            return None
        try:
            return self._serializer().loads(path.read_bytes())
        except Exception as exc:
            raise VirtualenvError(
                f"the return value of python_callable cannot be read outside the virtualenv"
                f" ({type(exc).__name__}: {exc}): return plain values"
            ) from None


class PythonVirtualenvOperator(_BaseVirtualenvOperator):
    """Runs ``python_callable`` in a virtualenv made for it: ``python_version`` (an installed
    ``python3.N``; default: the worker's), ``system_site_packages`` (default True, as Airflow),
    ``requirements`` (a list, or a requirements file: templated, ``.txt``) installed with pip
    (``pip_install_options``, ``index_urls``). Made afresh for each attempt and removed, unless
    ``venv_cache_path`` (or ``DEFERRAL_VENV_CACHE_PATH``) names a folder where virtualenvs are
    kept by what they hold and reused."""

    template_fields: Sequence[str] = (
        *PythonOperator.template_fields,
        "requirements",
        "index_urls",
        "venv_cache_path",
    )
    template_ext: Sequence[str] = (".txt",)

    def __init__(
        self,
        *,
        python_callable: Callable[..., Any],
        requirements: Iterable[str] | str | None = None,
        python_version: str | None = None,
        system_site_packages: bool = True,
        pip_install_options: Sequence[str] | None = None,
        index_urls: Sequence[str] | str | None = None,
        venv_cache_path: str | os.PathLike[str] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(python_callable=python_callable, **kwargs)
        where = f"task {self.task_id!r}"
        error = python_version_error(python_version)
        if error:
            raise DagDefinitionError(f"{where}: {error}")
        if isinstance(pip_install_options, str):
            raise DagDefinitionError(f"{where}: pip_install_options must be a list of str")
        self.requirements = (
            [requirements] if isinstance(requirements, str) else list(requirements or [])
        )
        self.python_version = python_version
        self.system_site_packages = system_site_packages
        self.pip_install_options = list(pip_install_options or [])
        self.index_urls = [index_urls] if isinstance(index_urls, str) else list(index_urls or [])
        self.venv_cache_path = venv_cache_path

    def spec(self) -> VirtualenvSpec:
        requirements = list(self.requirements)
        if not self.system_site_packages and self.serializer != "pickle":
            requirements.append(self.serializer)  # the script imports it (Airflow adds it too)
        return VirtualenvSpec(
            python=find_python(self.python_version),
            system_site_packages=self.system_site_packages,
            requirements=requirement_lines(requirements),
            pip_install_options=tuple(self.pip_install_options),
            index_urls=tuple(self.index_urls),
        )

    @contextmanager
    def virtualenv_python(self) -> Iterator[str]:
        spec = self.spec()
        cache = self.venv_cache_path or venv_cache_path()
        if cache:
            yield str(cached_virtualenv(Path(cache), spec, self.run_command))
            return
        with tempfile.TemporaryDirectory(prefix="deferral-venv-") as folder:
            yield str(prepare_virtualenv(Path(folder), spec, self.run_command))


class ExternalPythonOperator(_BaseVirtualenvOperator):
    """Runs ``python_callable`` with ``python``, the interpreter of a virtualenv made
    beforehand (templated; an absolute path)."""

    template_fields: Sequence[str] = (*PythonOperator.template_fields, "python")

    def __init__(
        self,
        *,
        python: str,
        python_callable: Callable[..., Any],
        expect_pendulum: bool = False,
        **kwargs: Any,
    ) -> None:
        super().__init__(python_callable=python_callable, **kwargs)
        if not python or not isinstance(python, str):
            raise DagDefinitionError(f"task {self.task_id!r}: python must be the path of a python")
        self.python = python
        self.expect_pendulum = expect_pendulum  # Airflow passes pendulum date-times then

    @contextmanager
    def virtualenv_python(self) -> Iterator[str]:
        if not os.path.isfile(self.python) or not os.access(self.python, os.X_OK):
            raise VirtualenvError(f"python {self.python!r} is not an executable file")
        yield self.python


class BranchPythonVirtualenvOperator(BranchPythonOperator, PythonVirtualenvOperator):
    """BranchPythonOperator's choice, made by a function run in a virtualenv."""


class BranchExternalPythonOperator(BranchPythonOperator, ExternalPythonOperator):
    """BranchPythonOperator's choice, made by a function run by another python."""
