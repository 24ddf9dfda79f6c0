"""Example cluster policies. Copy this file into your DAGs folder (or anywhere on the Python
path of every deferral process) and restart the services: each DAG is checked as it loads,
in the scheduler, the worker and the CLI alike.
"""

from __future__ import annotations

import datetime as dt
import re

from deferral import DAG, BaseOperator
from deferral.exceptions import ClusterPolicySkipDag, ClusterPolicyViolation
from deferral.loading.policies import MutableTaskInstance

DAG_ID = re.compile(r"[a-z][a-z0-9_]*")


def dag_policy(dag: DAG) -> None:
    """Refuse DAG ids out of the naming rule (an import error naming this policy); leave out
    DAGs parked as ``*_disabled`` quietly."""
    if dag.dag_id.endswith("_disabled"):
        raise ClusterPolicySkipDag()
    if not DAG_ID.fullmatch(dag.dag_id):
        raise ClusterPolicyViolation(f"DAG id {dag.dag_id!r} is not lower_snake_case")


def task_policy(task: BaseOperator) -> None:
    """Every task gets at least one retry and an execution timeout."""
    task.retries = max(task.retries, 1)
    if task.execution_timeout is None:
        task.execution_timeout = dt.timedelta(hours=1)


def task_instance_mutation_hook(task_instance: MutableTaskInstance) -> None:
    """Tasks named ``urgent_*`` go first."""
    if task_instance.task_id.startswith("urgent_"):
        task_instance.priority_weight += 100
