"""``DAG`` under Airflow's path ``airflow.models.dag``."""

from deferral.dag import DAG

__all__ = ["DAG"]
