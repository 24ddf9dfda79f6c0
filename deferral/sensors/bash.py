"""BashSensor (Airflow's ``airflow.sensors.bash``)."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Sequence
from typing import Any

from deferral.context import Context
from deferral.exceptions import DagDefinitionError, FailTask
from deferral.operators.bash import check_bash_arguments, context_environment, run_bash
from deferral.sensors.base import BaseSensorOperator


class BashSensor(BaseSensorOperator):
    """Pokes by running ``bash_command`` with ``bash -c`` in a temporary directory (its output
    goes to the task's log). Exit code 0 is done. Any other code means "not yet", unless
    ``retry_exit_code`` is set: then only that code means "not yet" and any other fails the
    task, as in Airflow 2.10. ``env`` replaces the worker's environment (the run's
    ``DEFERRAL_CTX_*`` / ``AIRFLOW_CTX_*`` ids are added either way)."""

    template_fields: Sequence[str] = ("bash_command", "env")

    def __init__(
        self,
        *,
        bash_command: str,
        env: dict[str, str] | None = None,
        output_encoding: str = "utf-8",
        retry_exit_code: int | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        where = f"task {self.task_id!r}"
        check_bash_arguments(where, bash_command, env, output_encoding)
        if retry_exit_code is not None and (
            not isinstance(retry_exit_code, int) or isinstance(retry_exit_code, bool)
        ):
            raise DagDefinitionError(f"{where}: retry_exit_code must be an int or None")
        self.bash_command = bash_command
        self.env = env
        self.output_encoding = output_encoding
        self.retry_exit_code = retry_exit_code

    def poke(self, context: Context) -> bool:
        env = dict(os.environ) if self.env is None else dict(self.env)
        env.update(context_environment(context))
        exit_code = self._run(env)
        print(f"bash sensor: command exited with code {exit_code}", flush=True)
        if exit_code == 0:
            return True
        if self.retry_exit_code is None or exit_code == self.retry_exit_code:
            return False
        raise FailTask(
            f"bash sensor command exited with code {exit_code}, "
            f"neither 0 nor retry_exit_code {self.retry_exit_code}"
        )

    def _run(self, env: dict[str, str]) -> int:
        with tempfile.TemporaryDirectory(prefix="deferral-bash-sensor-") as scratch:
            exit_code, _ = run_bash(
                self.bash_command, scratch, env, self.output_encoding, lambda _: None
            )
            return exit_code
