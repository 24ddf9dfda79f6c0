"""The task runtime a process that runs task code installs in the SDK's seam
(``deferral.store.seam.TaskRuntime``): the DAGs of this process's DAGs folder, and the user
actions a task may take on them, on this process's database."""

from __future__ import annotations

import datetime as dt
from typing import Any

from sqlalchemy import select

from deferral.dag import DAG
from deferral.loading.dagbag import process_dagbag
from deferral.store import actions
from deferral.store.metastore import metastore
from deferral.store.seam import install_task_runtime
from deferral.store.tables import Dag


def folder_dag(dag_id: str) -> DAG:
    """DAG ``dag_id`` of this process's bag, importing only the file the scheduler last
    parsed it from (the ``dag`` row's ``fileloc``): a process running one DAG's tasks never
    imports the rest of the folder, so no other file can stop or shadow it."""
    bag = process_dagbag()
    if dag_id in bag.dags:
        return bag.dags[dag_id]
    return bag.get_dag(dag_id, parsed_fileloc(dag_id))


def parsed_fileloc(dag_id: str) -> str | None:
    """The file a scheduler last parsed DAG ``dag_id`` from (None: none has)."""
    with metastore().sessions() as session:
        return session.scalar(select(Dag.fileloc).where(Dag.dag_id == dag_id))


class FolderTaskRuntime:
    def get_dag(self, dag_id: str) -> DAG:
        return folder_dag(dag_id)

    def trigger_run(
        self, dag: DAG, conf: dict[str, Any], run_id: str, *, logical_date: dt.datetime
    ) -> None:
        actions.trigger_run(metastore().sessions, dag, conf, run_id, logical_date=logical_date)

    def clear_run(self, dag: DAG, run_id: str) -> None:
        actions.clear_run(metastore().sessions, dag, run_id)


def install() -> None:
    install_task_runtime(FolderTaskRuntime())
