"""Helpers importable under Airflow's paths (``deferral.utils.task_group``)."""
