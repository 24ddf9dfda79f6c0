"""deferral: a workflow runtime whose tasks can defer their waits to async triggers."""

from deferral.baseoperator import BaseOperator, chain, cross_downstream
from deferral.connections import Connection
from deferral.context import Context
from deferral.dag import DAG
from deferral.decorators import dag, task, task_group
from deferral.utils.task_group import TaskGroup
from deferral.variables import Variable
from deferral.xcom_arg import XComArg

__all__ = [
    "DAG",
    "BaseOperator",
    "Connection",
    "Context",
    "TaskGroup",
    "Variable",
    "XComArg",
    "chain",
    "cross_downstream",
    "dag",
    "task",
    "task_group",
]
