"""The task runtime a process that runs task code installs in the SDK's seam
(``deferral.store.seam.TaskRuntime``): the DAGs of this process's DAGs folder, and the user
actions a task may take on them, on this process's database."""

from __future__ import annotations

import datetime as dt
from typing import Any

from deferral.dag import DAG
from deferral.loading.dagbag import process_dagbag
from deferral.store import actions
from deferral.store.metastore import metastore
from deferral.store.seam import install_task_runtime


class FolderTaskRuntime:
    def get_dag(self, dag_id: str) -> DAG:
        return process_dagbag().get_dag(dag_id)

    def trigger_run(
        self, dag: DAG, conf: dict[str, Any], run_id: str, *, logical_date: dt.datetime
    ) -> None:
        actions.trigger_run(metastore().sessions, dag, conf, run_id, logical_date=logical_date)

    def clear_run(self, dag: DAG, run_id: str) -> None:
        actions.clear_run(metastore().sessions, dag, run_id)


def install() -> None:
    install_task_runtime(FolderTaskRuntime())
