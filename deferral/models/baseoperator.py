"""``BaseOperator`` and its helpers under Airflow's path ``airflow.models.baseoperator``."""

from deferral.baseoperator import BaseOperator, chain, cross_downstream

__all__ = ["BaseOperator", "chain", "cross_downstream"]
