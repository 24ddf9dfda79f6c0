"""Built-in operators, importable from here or from their modules (Airflow's paths:
``deferral.operators.python``, ``deferral.operators.bash``, ``.latest_only`` ...)."""

from deferral.operators.bash import BashOperator
from deferral.operators.branch import BaseBranchOperator
from deferral.operators.datetime import BranchDateTimeOperator
from deferral.operators.empty import EmptyOperator
from deferral.operators.latest_only import LatestOnlyOperator, is_latest_run
from deferral.operators.python import BranchPythonOperator, PythonOperator, ShortCircuitOperator
from deferral.operators.trigger_dagrun import TriggerDagRunOperator
from deferral.operators.weekday import BranchDayOfWeekOperator

__all__ = [
    "BaseBranchOperator",
    "BashOperator",
    "BranchDateTimeOperator",
    "BranchDayOfWeekOperator",
    "BranchPythonOperator",
    "EmptyOperator",
    "LatestOnlyOperator",
    "PythonOperator",
    "ShortCircuitOperator",
    "TriggerDagRunOperator",
    "is_latest_run",
]
