"""Event-driven runs with assets, as an Airflow 3 user writes them (Airflow 2's `Dataset` works
too): a producer task updates an asset through its `outlets`; a consumer DAG scheduled on it
runs once per update and reads what triggered it in `triggering_asset_events`; a DAG scheduled
on `raw & reference` runs only once both were updated; a watcher turns each CSV file landing in
a folder into an asset event (a `RedisStreamTrigger` or `HttpPollTrigger` fits the same place).

`deferral dags trigger example_assets_producer` updates `orders`; `deferral assets list` shows
the assets, who updates and who waits for each, and their recent events.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

from deferral import DAG
from deferral.assets import Asset, AssetWatcher
from deferral.operators import PythonOperator
from deferral.triggers.event import DirectoryWatchTrigger

orders = Asset("orders", uri="s3://warehouse/orders/")
reference = Asset("reference")
landing_dir = os.path.join(tempfile.gettempdir(), "deferral-example-landing")
landing = Asset(
    "landing_files",
    watchers=[AssetWatcher("csv_files", DirectoryWatchTrigger(landing_dir, "*.csv"))],
)


def show_events(triggering_asset_events: Any) -> list[str]:
    seen = [
        f"{name}: event {event.id} from {event.source_dag_id or event.watcher} {event.extra}"
        for name in triggering_asset_events
        for event in triggering_asset_events[name]
    ]
    print("\n".join(seen))
    return seen


with DAG("example_assets_producer", schedule=None, tags=["example"]):
    PythonOperator(task_id="write_orders", python_callable=lambda: "written", outlets=[orders])

with DAG("example_assets_consumer", schedule=[orders], tags=["example"]):
    PythonOperator(task_id="read_orders", python_callable=show_events)

with DAG("example_assets_both", schedule=orders & reference, tags=["example"]):
    PythonOperator(task_id="join", python_callable=show_events)

with DAG(
    "example_assets_watcher", schedule=[landing], is_paused_upon_creation=True, tags=["example"]
):
    PythonOperator(task_id="load_file", python_callable=show_events)
