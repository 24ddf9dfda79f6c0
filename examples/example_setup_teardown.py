"""Setup and teardown tasks, and depends_on_past, written as Airflow's examples write them
(pendulum dates): the cluster is deleted even when the work fails, the run's state is the
work's, clearing ``load`` clears ``create_cluster`` and ``delete_cluster`` too, and each day's
``load`` waits for the previous day's to have succeeded."""

from __future__ import annotations

import pendulum

from deferral import DAG
from deferral.decorators import setup, task, teardown

with DAG(
    "example_setup_teardown",
    schedule="@daily",
    start_date=pendulum.datetime(2024, 1, 1, tz="UTC"),
    is_paused_upon_creation=True,
    dagrun_timeout=pendulum.duration(hours=1),
    default_args={"retry_delay": pendulum.duration(minutes=1)},
) as dag:

    @setup
    def create_cluster() -> str:
        return "cluster-1"

    @task(depends_on_past=True)
    def load(cluster: str) -> None:
        print(f"loading on {cluster}")

    @task(trigger_rule="all_done")
    def report() -> None:
        print("report")

    @teardown
    def delete_cluster(cluster: str) -> None:
        print(f"deleting {cluster}")

    cluster = create_cluster()
    with cluster >> delete_cluster(cluster):
        load(cluster) >> report()
