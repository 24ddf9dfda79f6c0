"""``@task`` and its variants ``@task.sensor``, ``@task.branch``, ``@task.short_circuit``,
``@task.bash``, and the operators they build."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from deferral.context import Context
from deferral.decorators.base import check_call_arguments, task_decorator
from deferral.operators.bash import BashOperator
from deferral.operators.python import (
    BranchExternalPythonOperator,
    BranchPythonOperator,
    BranchPythonVirtualenvOperator,
    ExternalPythonOperator,
    PythonOperator,
    PythonVirtualenvOperator,
    ShortCircuitOperator,
    call_with_context,
)
from deferral.sensors import BaseSensorOperator, PokeReturnValue


class DecoratedPythonOperator(PythonOperator):
    """What ``@task`` builds: a PythonOperator whose arguments were checked against the
    function's signature (``multiple_outputs``, as on any operator: its dict result is also
    pushed key by key, each key its own XCom)."""

    def __init__(
        self,
        *,
        python_callable: Callable[..., Any],
        op_args: Sequence[Any] = (),
        op_kwargs: dict[str, Any] | None = None,
        multiple_outputs: bool = False,
        **kwargs: Any,
    ) -> None:
        super().__init__(
            python_callable=python_callable,
            op_args=op_args,
            op_kwargs=op_kwargs,
            multiple_outputs=multiple_outputs,
            **kwargs,
        )
        check_call_arguments(self.task_id, python_callable, self.op_args, self.op_kwargs)


class DecoratedBranchOperator(DecoratedPythonOperator, BranchPythonOperator):
    """What ``@task.branch`` builds."""


class DecoratedShortCircuitOperator(DecoratedPythonOperator, ShortCircuitOperator):
    """What ``@task.short_circuit`` builds."""


class DecoratedVirtualenvOperator(DecoratedPythonOperator, PythonVirtualenvOperator):
    """What ``@task.virtualenv`` builds."""


class DecoratedExternalPythonOperator(DecoratedPythonOperator, ExternalPythonOperator):
    """What ``@task.external_python`` builds."""


class DecoratedBranchVirtualenvOperator(DecoratedPythonOperator, BranchPythonVirtualenvOperator):
    """What ``@task.branch_virtualenv`` builds."""


class DecoratedBranchExternalPythonOperator(DecoratedPythonOperator, BranchExternalPythonOperator):
    """What ``@task.branch_external_python`` builds."""


class DecoratedSensorOperator(BaseSensorOperator):
    """What ``@task.sensor`` builds: ``poke`` calls the function, which returns a bool or a
    PokeReturnValue (whose ``xcom_value`` is the task's return value once done)."""

    template_fields: Sequence[str] = ("op_args", "op_kwargs")

    def __init__(
        self,
        *,
        python_callable: Callable[..., Any],
        op_args: Sequence[Any] = (),
        op_kwargs: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.python_callable = python_callable
        self.op_args = list(op_args)
        self.op_kwargs = dict(op_kwargs or {})
        check_call_arguments(self.task_id, python_callable, self.op_args, self.op_kwargs)

    def poke(self, context: Context) -> bool | PokeReturnValue:
        result = call_with_context(self.python_callable, self.op_args, self.op_kwargs, context)
        return result if isinstance(result, PokeReturnValue) else bool(result)


class DecoratedBashOperator(BashOperator):
    """What ``@task.bash`` builds: the function, called when the task runs, returns the bash
    command to run."""

    template_fields: Sequence[str] = ("op_args", "op_kwargs", "env", "cwd")

    def __init__(
        self,
        *,
        python_callable: Callable[..., Any],
        op_args: Sequence[Any] = (),
        op_kwargs: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        # The command exists only once the function ran: a stand-in until then.
        super().__init__(bash_command="@task.bash", **kwargs)
        self.python_callable = python_callable
        self.op_args = list(op_args)
        self.op_kwargs = dict(op_kwargs or {})
        check_call_arguments(self.task_id, python_callable, self.op_args, self.op_kwargs)

    def execute(self, context: Context) -> Any:
        command = call_with_context(self.python_callable, self.op_args, self.op_kwargs, context)
        if not isinstance(command, str) or not command.strip():
            raise TypeError(
                f"@task.bash task {self.task_id!r} must return the command to run as a"
                f" non-empty str, got {command!r}"
            )
        self.bash_command = command
        return super().execute(context)


def _returning(
    kind: str, operator_class: type[DecoratedPythonOperator], doc: str
) -> Callable[..., Any]:
    """The ``@task.<variant>`` method of a variant whose function returns its value
    (``multiple_outputs``: each key of a returned dict is also its own XCom)."""

    def variant(
        self: TaskDecoratorCollection,
        python_callable: Callable[..., Any] | None = None,
        *,
        multiple_outputs: bool | None = None,
        **kwargs: Any,
    ) -> Any:
        kwargs["multiple_outputs"] = multiple_outputs
        return task_decorator(kind, operator_class, python_callable, kwargs)

    variant.__doc__ = doc
    return variant


class TaskDecoratorCollection:
    """``task``: ``@task`` / ``@task(...)`` for a PythonOperator task, and the variants as
    attributes (``@task.sensor``, ``@task.branch``, ``@task.short_circuit``, ``@task.bash``).
    Keyword arguments are the operator's (``task_id``, ``retries``, ``multiple_outputs`` ...)."""

    def __call__(
        self,
        python_callable: Callable[..., Any] | None = None,
        *,
        multiple_outputs: bool | None = None,
        **kwargs: Any,
    ) -> Any:
        return self.python(python_callable, multiple_outputs=multiple_outputs, **kwargs)

    python = _returning(
        "@task",
        DecoratedPythonOperator,
        """``multiple_outputs``: push each key of the dict the function returns as its own XCom;
        by default, when its return annotation is a dict (or another mapping).""",
    )
    branch = _returning(
        "@task.branch",
        DecoratedBranchOperator,
        "The function returns the task id(s) or task group id(s) to follow, or None.",
    )
    short_circuit = _returning(
        "@task.short_circuit",
        DecoratedShortCircuitOperator,
        "A falsy result skips downstream (``ignore_downstream_trigger_rules=...``).",
    )
    virtualenv = _returning(
        "@task.virtualenv",
        DecoratedVirtualenvOperator,
        """The function runs in a virtualenv made for it: ``requirements``, ``python_version``,
        ``system_site_packages``, ``venv_cache_path`` ... as PythonVirtualenvOperator.""",
    )
    external_python = _returning(
        "@task.external_python",
        DecoratedExternalPythonOperator,
        "The function runs with ``python=``, an existing virtualenv's interpreter.",
    )
    branch_virtualenv = _returning(
        "@task.branch_virtualenv",
        DecoratedBranchVirtualenvOperator,
        "``@task.branch`` whose function runs in a virtualenv, as ``@task.virtualenv``.",
    )
    branch_external_python = _returning(
        "@task.branch_external_python",
        DecoratedBranchExternalPythonOperator,
        "``@task.branch`` whose function runs with ``python=``, as ``@task.external_python``.",
    )

    def sensor(self, python_callable: Callable[..., Any] | None = None, **kwargs: Any) -> Any:
        """``poke_interval``, ``timeout``, ``mode``, ``soft_fail`` ... as BaseSensorOperator."""
        return task_decorator("@task.sensor", DecoratedSensorOperator, python_callable, kwargs)

    def bash(self, python_callable: Callable[..., Any] | None = None, **kwargs: Any) -> Any:
        """The function returns the command; ``env``, ``cwd``, ``skip_on_exit_code`` ... as
        BashOperator."""
        return task_decorator("@task.bash", DecoratedBashOperator, python_callable, kwargs)


task = TaskDecoratorCollection()
