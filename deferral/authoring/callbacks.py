"""Callbacks of tasks and DAGs (``on_success_callback`` ...): a callable or a list of callables,
each called with the context; one that raises is logged and changes nothing else.

Task callbacks run in the task's child process (worker.attempt). DAG callbacks run where a DAG
run finishes, through :func:`run_dag_callbacks`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from deferral.context import DagRunInfo, RuntimeTaskInstance
    from deferral.dag import DAG

log = logging.getLogger("deferral.authoring.callbacks")

Callback = Callable[[Any], Any]
CallbackArg = Callback | Sequence[Callback] | None

# The ``reason`` a DAG callback's context carries, as Airflow's.
REASON_SUCCESS = "success"
REASON_TASK_FAILURE = "task_failure"
REASON_TIMED_OUT = "timed_out"


def check_callbacks(owner: str, name: str, value: CallbackArg) -> CallbackArg:
    """``value`` if it is None, a callable or a list of callables; else a DagDefinitionError
    naming ``owner`` (``task 'x'`` / ``DAG 'y'``) and the argument."""
    if value is None or callable(value):
        return value
    if isinstance(value, list | tuple) and all(callable(item) for item in value):
        return value
    from deferral.exceptions import DagDefinitionError

    raise DagDefinitionError(
        f"{owner}: {name} must be a callable or a list of callables, got {value!r}"
    )


def as_list(value: CallbackArg) -> list[Callback]:
    if value is None:
        return []
    return [value] if callable(value) else list(value)


def _name(callback: Callback) -> str:
    return getattr(callback, "__qualname__", None) or repr(callback)


def run_callbacks(value: CallbackArg, context: Mapping[str, Any], *, what: str) -> list[str]:
    """Call each callback with ``context``, in order; one that raises is logged (naming
    ``what``, e.g. ``task 'x' on_failure_callback``) and the next still runs. Returns one line
    per callback that raised."""
    errors: list[str] = []
    for callback in as_list(value):
        try:
            callback(context)
        except Exception as exc:
            line = f"{what} {_name(callback)} raised {type(exc).__name__}: {exc}".splitlines()[0]
            log.exception("%s (ignored: a callback never changes the outcome)", line)
            errors.append(line)
    return errors


def dag_callback_context(
    dag: DAG, run: DagRunInfo, reason: str, ti: RuntimeTaskInstance | None = None
) -> dict[str, Any]:
    """What a DAG callback receives: the run's context and ``reason``; with ``ti`` (e.g. the
    task instance that failed the run) also ``ti``, ``task_instance`` and ``task``."""
    context: dict[str, Any] = {
        "dag": dag,
        "dag_run": run,
        "run_id": run.run_id,
        "logical_date": run.logical_date,
        "params": {**dag.params, **run.conf},
        "reason": reason,
    }
    if ti is not None:
        context.update(ti=ti, task_instance=ti, task=dag.task_dict.get(ti.task_id))
    return context


def run_dag_callbacks(
    dag: DAG,
    run: DagRunInfo,
    *,
    success: bool,
    reason: str,
    ti: RuntimeTaskInstance | None = None,
) -> list[str]:
    """Call the DAG's ``on_success_callback`` (``success``) or ``on_failure_callback`` once its
    run finished. ``reason``: REASON_SUCCESS, REASON_TASK_FAILURE or REASON_TIMED_OUT. Returns
    one line per callback that raised (each is logged already)."""
    name = "on_success_callback" if success else "on_failure_callback"
    return run_callbacks(
        getattr(dag, name),
        dag_callback_context(dag, run, reason, ti),
        what=f"DAG {dag.dag_id!r} {name}",
    )
