"""Helpers importable under Airflow's paths: ``deferral.utils.task_group``, ``.dates``,
``.trigger_rule``, ``.edgemodifier``, ``.weekday``."""
