"""``XComArg`` under Airflow's path ``airflow.models.xcom_arg``."""

from deferral.xcom_arg import XComArg

__all__ = ["XComArg"]
