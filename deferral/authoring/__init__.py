"""The authoring SDK's inner parts, behind the public modules DAG files import (``deferral``,
``deferral.operators`` …): dependencies between tasks, mapping, setup and teardown, callbacks,
templating, schedules, and what deferral does with Airflow's arguments."""
