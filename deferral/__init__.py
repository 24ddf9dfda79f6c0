"""deferral: a workflow runtime whose tasks can defer their waits to async triggers."""

from deferral.baseoperator import BaseOperator, chain, cross_downstream
from deferral.context import Context
from deferral.dag import DAG

__all__ = ["DAG", "BaseOperator", "Context", "chain", "cross_downstream"]
