"""Sensors as an Airflow user writes them: a deferrable FileSensor on a glob, a DateTimeSensor
given a naive datetime (read in DEFERRAL_DEFAULT_TIMEZONE), and a custom reschedule-mode sensor
with exponential backoff whose poke returns a value for the next task.

Trigger it and drop a CSV file under /tmp/deferral-example/landing/ (in any subfolder) within
two minutes; otherwise the FileSensor is skipped (soft_fail) and the run goes on.
"""

from __future__ import annotations

import datetime as dt
import glob
import os
from typing import Any

from deferral import DAG, Context
from deferral.operators import PythonOperator
from deferral.sensors import BaseSensorOperator, DateTimeSensorAsync, FileSensor, PokeReturnValue

LANDING = "/tmp/deferral-example/landing"


class CsvFilesLanded(BaseSensorOperator):
    """Done once ``min_files`` CSV files sit under ``folder``; returns their names."""

    def __init__(self, *, folder: str, min_files: int = 1, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.folder = folder
        self.min_files = min_files

    def poke(self, context: Context) -> PokeReturnValue:
        files = sorted(glob.glob(os.path.join(self.folder, "**", "*.csv"), recursive=True))
        return PokeReturnValue(len(files) >= self.min_files, xcom_value=files)


def report(ti: Any) -> str:
    files = ti.xcom_pull(task_ids="csv_files") or []
    message = f"{len(files)} file(s) landed: {files}"
    print(message)
    return message


with DAG("example_sensors", schedule=None) as dag:
    # A naive datetime, as most DAG files write them: 06:00 in the default time zone. It has
    # passed, so the sensor returns from its first poke and never defers.
    not_before = DateTimeSensorAsync(task_id="not_before", target_time=dt.datetime(2024, 1, 1, 6))
    # Pokes once, then hands the wait to a FileTrigger (no worker slot held); a folder counts
    # only once a file sits in it. Past the timeout: skipped, not failed (soft_fail).
    landed = FileSensor(
        task_id="landed",
        filepath=f"{LANDING}/**/*.csv",
        recursive=True,
        deferrable=True,
        poke_interval=2,
        timeout=dt.timedelta(minutes=2),
        soft_fail=True,
    )
    # Frees its slot between pokes; the delay grows (10 s, 20 s, 40 s... at most 60 s).
    csv_files = CsvFilesLanded(
        task_id="csv_files",
        folder=LANDING,
        mode="reschedule",
        poke_interval=dt.timedelta(seconds=10),
        exponential_backoff=True,
        max_wait=dt.timedelta(minutes=1),
        timeout=dt.timedelta(minutes=3),
        soft_fail=True,
    )
    done = PythonOperator(task_id="report", python_callable=report, trigger_rule="all_done")
    not_before >> landed >> csv_files >> done
