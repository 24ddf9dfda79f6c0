"""The one door from the authoring SDK into the store. What DAG-file code may reach of the
running system goes through here, and nothing else of ``deferral.store`` or
``deferral.loading`` is imported by the SDK (``tests/unit/test_layers.py``):

- Variables, Connections and rendered template fields: the engine and cipher of this process
  (``metastore``) and their tables;
- runs and task instances read by sensors and operators (``DagRun``, ``TaskInstance``);
- the DAGs a task names and the runs it triggers or clears (``TriggerDagRunOperator``,
  ``ExternalTaskSensor``): these live above the SDK (DAG loading, user actions), so the process
  that runs task code installs them here as a ``TaskRuntime`` (``install_task_runtime``) and the
  SDK asks ``task_runtime()``;
- what a task's context offers: its triggering asset events, its callback token, its state
  stores;
- signals and approvals: their rows, their checks, and the transitions they cause; the waits
  held as rows (composites, filters, cancel-on) that signals resolve; a signal's idempotency
  key (``idempotency``); several statements sent in one round trip (``pipelined``).

A new need of the SDK is added here, by name, so the seam stays the list of what crosses."""

from __future__ import annotations

import datetime as dt
from typing import TYPE_CHECKING, Any, Protocol

from deferral.store import idempotency, transitions, waits
from deferral.store.asset_events import LazyInletEvents, LazyTriggeringEvents
from deferral.store.callback_tokens import (
    CALLBACK_KEY_PREFIX,
    TOKEN_LIFETIME,
    CallbackHandle,
    Claim,
    TokenRefused,
    parse_token,
)
from deferral.store.db import pipelined
from deferral.store.hitl import InputRequest, check_request, record_request
from deferral.store.metastore import metastore
from deferral.store.state_stores import NEVER_EXPIRE, AssetStateStores, TaskStateStore
from deferral.store.tables import (
    DagRun,
    RenderedTaskInstanceFields,
    SignalWait,
    StoredConnection,
    StoredVariable,
    TaskInstance,
    WaitTimer,
)

if TYPE_CHECKING:
    from deferral.dag import DAG

__all__ = [
    "CALLBACK_KEY_PREFIX",
    "NEVER_EXPIRE",
    "TOKEN_LIFETIME",
    "AssetStateStores",
    "CallbackHandle",
    "Claim",
    "DagRun",
    "InputRequest",
    "LazyInletEvents",
    "LazyTriggeringEvents",
    "RenderedTaskInstanceFields",
    "SignalWait",
    "StoredConnection",
    "StoredVariable",
    "TaskInstance",
    "TaskRuntime",
    "TaskStateStore",
    "TokenRefused",
    "WaitTimer",
    "check_request",
    "idempotency",
    "install_task_runtime",
    "metastore",
    "parse_token",
    "pipelined",
    "record_request",
    "task_runtime",
    "transitions",
    "waits",
]


class TaskRuntime(Protocol):
    """What task code asks of the process running it beyond the store's rows. ``get_dag`` raises
    ``deferral.exceptions.DagNotFound``; ``trigger_run`` raises ``ActionError`` when refused
    (a run of that id or logical date exists, a param refuses the conf)."""

    def get_dag(self, dag_id: str) -> DAG: ...

    def trigger_run(
        self, dag: DAG, conf: dict[str, Any], run_id: str, *, logical_date: dt.datetime
    ) -> None: ...

    def clear_run(self, dag: DAG, run_id: str) -> None: ...


_task_runtime: TaskRuntime | None = None


def install_task_runtime(runtime: TaskRuntime) -> None:
    """Called by the process that runs task code (a worker's task process, ``dags test``)
    before any task runs."""
    global _task_runtime
    _task_runtime = runtime


def task_runtime() -> TaskRuntime:
    if _task_runtime is None:
        raise RuntimeError("no task runtime is installed in this process: tasks run in a worker")
    return _task_runtime
