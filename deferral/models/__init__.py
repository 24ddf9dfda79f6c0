"""``deferral.models``: Airflow's ``airflow.models`` path. The tables themselves are the store's
(:mod:`deferral.store.tables`); they are offered here under the names Airflow's DAG files and
plugins use, with the authoring classes Airflow also exports from it."""

from __future__ import annotations

from typing import Any

from deferral.store.tables import (
    AssetDagRunQueue,
    AssetEventRow,
    AssetModel,
    AssetWatcherRow,
    Base,
    Dag,
    DagImportError,
    DagRun,
    DagRunAssetEvent,
    DagScheduleAsset,
    DeadlineMiss,
    HITLDetail,
    Outbox,
    Pool,
    RenderedTaskInstanceFields,
    ResumeEvent,
    Scheduler,
    Signal,
    SignalWait,
    StoredConnection,
    StoredVariable,
    TaskInstance,
    TaskLog,
    TaskLogTry,
    TaskOutletAsset,
    TaskReschedule,
    TaskStateChange,
    Trigger,
    Triggerer,
    User,
    WebSession,
    Worker,
    XCom,
)

__all__ = [
    "AssetDagRunQueue",
    "AssetEventRow",
    "AssetModel",
    "AssetWatcherRow",
    "Base",
    "Dag",
    "DagImportError",
    "DagRun",
    "DagRunAssetEvent",
    "DagScheduleAsset",
    "DeadlineMiss",
    "HITLDetail",
    "Outbox",
    "Pool",
    "RenderedTaskInstanceFields",
    "ResumeEvent",
    "Scheduler",
    "Signal",
    "SignalWait",
    "StoredConnection",
    "StoredVariable",
    "TaskInstance",
    "TaskLog",
    "TaskLogTry",
    "TaskOutletAsset",
    "TaskReschedule",
    "TaskStateChange",
    "Trigger",
    "Triggerer",
    "User",
    "WebSession",
    "Worker",
    "XCom",
]

# Airflow's ``airflow.models`` also exports the authoring classes; they are offered here by
# name, imported on first use (they import this module's neighbours, not the tables).
_AUTHORING = {
    "DAG": "deferral.dag",
    "BaseOperator": "deferral.baseoperator",
    "Param": "deferral.models.param",
    "ParamsDict": "deferral.models.param",
    "Variable": "deferral.variables",
    "Connection": "deferral.connections",
}


def __getattr__(name: str) -> Any:
    if name in _AUTHORING:
        import importlib

        return getattr(importlib.import_module(_AUTHORING[name]), name)
    raise AttributeError(f"module 'deferral.models' has no attribute {name!r}")
