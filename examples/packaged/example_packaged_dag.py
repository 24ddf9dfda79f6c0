"""A DAG shipped as a zip archive: put the archive in the DAGs folder; its top-level ``.py``
files are DAG files and its folders are packages they import. Build it from this folder with

    python -m zipfile -c ../example_packaged.zip example_packaged_dag.py example_packaged_lib

and list ``example_packaged_lib`` in DEFERRAL_TRIGGER_MODULES so the triggerer may import the
trigger defined inside the archive.
"""

from __future__ import annotations

from typing import Any

from example_packaged_lib.triggers import CountdownTrigger

from deferral import DAG, BaseOperator, Context


class Countdown(BaseOperator):
    def __init__(self, *, seconds: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.seconds = seconds

    def execute(self, context: Context) -> None:
        self.defer(trigger=CountdownTrigger(self.seconds), method_name="done")

    def done(self, context: Context, event: str) -> str:
        return event


with DAG("example_packaged", schedule=None) as dag:
    Countdown(task_id="countdown", seconds=3)
