"""BashOperator: runs a command with ``bash -c`` in a process group of its own."""

from __future__ import annotations

import codecs
import contextlib
import ctypes
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import warnings
from collections.abc import Callable, Container, Mapping, Sequence
from typing import Any

from deferral.baseoperator import BaseOperator
from deferral.context import Context
from deferral.exceptions import DagDefinitionError, DeferralException, SkipTask
from deferral.xcom_arg import RuntimeArg

# How long the command's processes get to stop after SIGTERM before SIGKILL.
KILL_GRACE_SEC = 5.0


class BashCommandError(DeferralException):
    """The bash command exited with a code that is neither 0 nor a skip code."""


def _is_text(value: Any) -> bool:
    return isinstance(value, str | RuntimeArg)


class BashOperator(BaseOperator):
    """Runs ``bash_command`` with ``bash -c``; its output (stdout and stderr) goes to the task's
    log, and its last line becomes the XCom ``return_value`` (unless ``do_xcom_push=False``).

    - ``env``: the command's environment instead of the worker's; with ``append_env=True``,
      added to the worker's. The run's ids are exported as ``DEFERRAL_CTX_*`` (and Airflow's
      ``AIRFLOW_CTX_*``) either way.
    - ``cwd``: the working directory (default: a temporary directory, removed afterwards).
    - exit code 0 succeeds; one in ``skip_on_exit_code`` (default 99; an int, a collection of
      ints, or None) skips the task; any other fails it, naming the code.
    - the command runs in a process group of its own: when the task is cut short (its
      execution_timeout passed, or ``on_kill``) the whole group is stopped, SIGTERM then SIGKILL.
    """

    template_fields: Sequence[str] = ("bash_command", "env", "cwd")
    # A bash_command ending so is a template file (add a space after a script's name to run it).
    template_ext: Sequence[str] = (".sh", ".bash")

    def __init__(
        self,
        *,
        bash_command: str,
        env: dict[str, str] | None = None,
        append_env: bool = False,
        output_encoding: str = "utf-8",
        skip_on_exit_code: int | Container[int] | None = 99,
        cwd: str | None = None,
        output_processor: Callable[[str], Any] | None = None,
        skip_exit_code: int | Container[int] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        where = f"task {self.task_id!r}"
        if skip_exit_code is not None:  # Airflow 2's deprecated name
            warnings.warn(
                "skip_exit_code is deprecated (as in Airflow 2.6+): use skip_on_exit_code",
                DeprecationWarning,
                stacklevel=3,
            )
            skip_on_exit_code = skip_exit_code
        if output_processor is not None and not callable(output_processor):
            raise DagDefinitionError(f"{where}: output_processor must be callable")
        self.output_processor = output_processor
        check_bash_arguments(where, bash_command, env, output_encoding)
        if cwd is not None and not _is_text(cwd):
            raise DagDefinitionError(f"{where}: cwd must be a path string")
        self.bash_command = bash_command
        self.env = env
        self.append_env = append_env
        self.output_encoding = output_encoding
        self.skip_on_exit_code = skip_codes(where, skip_on_exit_code)
        self.cwd = cwd
        self._process: subprocess.Popen[bytes] | None = None

    def execute(self, context: Context) -> Any:
        if not isinstance(self.bash_command, str) or not self.bash_command:
            raise BashCommandError(f"bash_command is {self.bash_command!r}, not a command")
        env = self._environment(context)
        if self.cwd is not None:
            if not os.path.exists(self.cwd):
                raise BashCommandError(f"cwd {self.cwd!r} does not exist")
            if not os.path.isdir(self.cwd):
                raise BashCommandError(f"cwd {self.cwd!r} is not a directory")
            exit_code, last_line = self._run(self.cwd, env)
        else:
            with tempfile.TemporaryDirectory(prefix="deferral-bash-") as scratch:
                exit_code, last_line = self._run(scratch, env)
        if exit_code == 0:
            # Airflow's output_processor: turns the last line into the value pushed.
            return self.output_processor(last_line) if self.output_processor else last_line
        if exit_code in self.skip_on_exit_code:
            raise SkipTask(f"bash command exited with code {exit_code} (skip_on_exit_code)")
        raise BashCommandError(f"bash command failed with exit code {exit_code}")

    def on_kill(self) -> None:
        if self._process is not None:
            stop_process_group(self._process)

    def _environment(self, context: Context) -> dict[str, str]:
        if self.env is None:
            env = dict(os.environ)
        elif self.append_env:
            env = {**os.environ, **self.env}
        else:
            env = dict(self.env)
        for key, value in env.items():
            if not isinstance(value, str):
                raise TypeError(f"env[{key!r}] must be a str, got {type(value).__name__}")
        env.update(context_environment(context))
        return env

    def _run(self, cwd: str, env: dict[str, str]) -> tuple[int, str]:
        def started(process: subprocess.Popen[bytes] | None) -> None:
            self._process = process  # what on_kill stops

        return run_bash(self.bash_command, cwd, env, self.output_encoding, started)


def check_bash_arguments(where: str, bash_command: Any, env: Any, output_encoding: str) -> None:
    """BashOperator's and BashSensor's checks of their common arguments, at load."""
    if not _is_text(bash_command) or (isinstance(bash_command, str) and not bash_command):
        raise DagDefinitionError(f"{where}: bash_command must be a non-empty string")
    if env is not None and not isinstance(env, dict | RuntimeArg):
        raise DagDefinitionError(f"{where}: env must be a dict of str to str")
    for key, value in env.items() if isinstance(env, dict) else ():
        if not isinstance(key, str) or not _is_text(value):
            raise DagDefinitionError(
                f"{where}: env[{key!r}] must be a str, got {type(value).__name__}"
            )
    try:
        codecs.lookup(output_encoding)
    except (LookupError, TypeError):
        raise DagDefinitionError(f"{where}: unknown output_encoding {output_encoding!r}") from None


def run_bash(
    command: str,
    cwd: str,
    env: dict[str, str],
    output_encoding: str,
    started: Callable[[subprocess.Popen[bytes] | None], None],
) -> tuple[int, str]:
    """Run ``command`` with ``bash -c`` to its end, as ``run_process``."""
    return run_process(
        [shutil.which("bash") or "bash", "-c", command], cwd, env, output_encoding, started
    )


def run_process(
    argv: list[str],
    cwd: str,
    env: dict[str, str],
    output_encoding: str,
    started: Callable[[subprocess.Popen[bytes] | None], None],
) -> tuple[int, str]:
    """Run ``argv`` to its end; (exit code, last line of output), each line printed to the
    task's log. ``started`` is told of the process, then of None once it ended. However this
    ends early (execution_timeout raised in here, any error), the process group is stopped."""
    process = subprocess.Popen(
        argv,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        cwd=cwd,
        env=env,
        start_new_session=True,  # its own process group, to stop as a whole
        preexec_fn=_die_with_task_process(),
    )
    started(process)
    finished = False
    try:
        assert process.stdout is not None
        last_line = ""
        for raw in iter(process.stdout.readline, b""):
            last_line = raw.decode(output_encoding, errors="backslashreplace").rstrip()
            print(last_line, flush=True)
        exit_code = process.wait()
        finished = True
        return exit_code, last_line
    finally:
        if not finished:
            stop_process_group(process)
        if process.stdout is not None:
            process.stdout.close()
        started(None)


def _die_with_task_process() -> Callable[[], None] | None:
    """On Linux, a function for the forked child that has the kernel SIGKILL bash when the task
    process dies (a worker killed with -9 takes its task processes with it). libc is loaded here,
    in the parent: the forked child only makes the one call."""
    if not sys.platform.startswith("linux"):
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl
    pr_set_pdeathsig = 1

    def set_parent_death_signal() -> None:
        prctl(pr_set_pdeathsig, signal.SIGKILL, 0, 0, 0)

    return set_parent_death_signal


def stop_process_group(process: subprocess.Popen[bytes]) -> None:
    """SIGTERM the process group led by ``process``, SIGKILL it after KILL_GRACE_SEC if its
    leader is still alive by then (and to catch members that outlived it), and reap the
    leader."""
    try:
        os.killpg(process.pid, signal.SIGTERM)
    except ProcessLookupError:
        process.poll()
        return
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(timeout=KILL_GRACE_SEC)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()


def context_environment(context: Mapping[str, Any]) -> dict[str, str]:
    """The run's ids for a subprocess: DEFERRAL_CTX_* and, for scripts brought from Airflow,
    the AIRFLOW_CTX_* names of the same values."""
    ti = context["ti"]
    values = {
        "DAG_ID": ti.dag_id,
        "TASK_ID": ti.task_id,
        "DAG_RUN_ID": ti.run_id,
        "TRY_NUMBER": str(ti.try_number),
        "LOGICAL_DATE": context["logical_date"].isoformat(),
    }
    env = {f"DEFERRAL_CTX_{name}": value for name, value in values.items()}
    env.update({f"AIRFLOW_CTX_{name}": value for name, value in values.items()})
    env["AIRFLOW_CTX_EXECUTION_DATE"] = values["LOGICAL_DATE"]
    return env


def skip_codes(where: str, value: int | Container[int] | None) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int) and not isinstance(value, bool):
        return (value,)
    if isinstance(value, list | tuple | set | frozenset) and all(
        isinstance(code, int) and not isinstance(code, bool) for code in value
    ):
        return tuple(value)
    raise DagDefinitionError(
        f"{where}: skip_on_exit_code must be an int, a list of ints or None, got {value!r}"
    )
