"""``TriggerRule`` under Airflow's path ``airflow.utils.trigger_rule``."""

from deferral.trigger_rules import TriggerRule

__all__ = ["TriggerRule"]
