"""Airflow 3's own example DAGs (tests/airflow_examples, as Airflow ships them) whose tasks need
no database, each task run in this process by worker.attempt under the import hook (the
folder's .deferral.toml turns it on), in the order `airflow dags test` runs them: each ends in
the state `airflow dags test` gave it (airflow_states.json). Those that read or write the
database are run with `deferral dags test` in tests/integration/test_airflow3_examples.py."""

from __future__ import annotations

import datetime as dt
import json
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from cryptography.fernet import Fernet

from deferral.authoring import templating
from deferral.loading import task_runtime
from deferral.loading.dagbag import process_dagbag
from deferral.store import assets as stored_assets
from worker import attempt
from worker.outcomes import AttemptRequest, Failed, Skipped, Succeeded

EXAMPLES = Path(__file__).resolve().parents[1] / "airflow_examples"
# What `airflow dags test` gave each DAG (tests/airflow_examples/record_airflow_states.py).
AIRFLOW = json.loads((EXAMPLES / "airflow_states.json").read_text())["dags"]

# The DAGs whose tasks need no database, each one task. Every DAG of
# example_asset_partition.py: what they show is that the partitioned timetables, mappers,
# windows and wait policies build, and a task reads its run's partition key and emits
# partitions at runtime.
NO_DATABASE = [
    "ingest_team_a_player_stats",
    "team_b_player_stats",
    "team_c_player_stats",
    "clean_and_combine_player_stats",
    "compute_player_odds",
    "player_odds_quality_check_wont_ever_to_trigger",
    "ingest_regional_sales",
    "aggregate_regional_sales",
    "ingest_region_stats",
    "regional_stats_breakdown",
    "live_region_player_stats",
    "summarize_live_region_stats",
    "multi_region_player_stats",
    "daily_team_a_rollup",
    "monthly_team_a_rollup",
    "train_weekly_model",
    "daily_inference",
    "trailing_week_inference",
    "segment_region_stats_rollup",
    "segment_region_stats_early_rollup",
    "scatter_live_region_to_segments",
    # example_asset_alias.py and example_asset_alias_with_no_taskflow.py (the alias's
    # consumers read the database: the integration test).
    "asset_s3_bucket_producer",
    "asset_s3_bucket_consumer",
    "asset_alias_example_alias_producer_with_no_taskflow",
    "asset_s3_bucket_producer_with_no_taskflow",
    "asset_s3_bucket_consumer_with_no_taskflow",
    # example_external_task_marker_dag.py (its child waits on the parent's run: the
    # integration test).
    "example_external_task_marker_parent",
    # example_asset_decorator.py (asset2_producer reads inlet events: the integration test).
    "asset1_producer",
    "consumes_asset_decorator",
    # example_custom_weight.py: the weight_rule of the plugin's priority strategy, given as an
    # instance and as a dotted path of Airflow's package (the weights: test_airflow_arguments).
    "example_custom_weight",
    # example_workday_timetable.py: the plugin's timetable (test_timetables).
    "example_workday_timetable",
    # example_asset_allow_teams.py: an asset's AssetAccessControl, one team as Airflow's
    # without multi_team.
    "team_analytics_producer",
    "team_ml_consumer",
]


@pytest.fixture(scope="module")
def examples_folder() -> Iterator[None]:
    """worker.attempt reads the DAGs from the examples folder; settings point at servers never
    used (no task here reaches them)."""
    patch = pytest.MonkeyPatch()
    patch.setattr(sys, "path", list(sys.path))
    patch.setattr(templating, "record_rendered_fields", lambda *args: None)
    # Nor which assets are active (tests/integration/test_asset_uris.py): all are, here.
    patch.setattr(stored_assets, "inactive_in_store", lambda assets: [])
    patch.setattr(task_runtime, "parsed_fileloc", lambda dag_id: None)
    patch.delenv("DEFERRAL_AIRFLOW_IMPORTS", raising=False)
    env = {
        "DEFERRAL_DATABASE_URL": "postgresql+psycopg://nobody@127.0.0.1:1/never_used",
        "DEFERRAL_REDIS_URL": "redis://127.0.0.1:1/0",
        "DEFERRAL_FERNET_KEY": Fernet.generate_key().decode(),
        "DEFERRAL_DAGS_FOLDER": str(EXAMPLES),
    }
    for key, value in env.items():
        patch.setenv(key, value)
    process_dagbag.cache_clear()
    attempt._xcoms.cache_clear()
    yield
    process_dagbag.cache_clear()
    attempt._xcoms.cache_clear()
    patch.undo()


def _state(outcome: object) -> str:
    if isinstance(outcome, Succeeded):
        return "success"
    if isinstance(outcome, Skipped):
        return "skipped"
    assert isinstance(outcome, Failed)
    return f"failed: {outcome.error}"


def _request(dag_id: str, task_id: str) -> AttemptRequest:
    return AttemptRequest(
        task_instance_id=1,
        dag_id=dag_id,
        run_id="manual__2026-06-14",
        task_id=task_id,
        map_index=-1,
        try_number=1,
        logical_date=dt.datetime(2026, 6, 14, 3, tzinfo=dt.UTC),
        conf={},
        first_started_at=dt.datetime.now(dt.UTC),
        next_method=None,
        next_kwargs=None,
        max_tries=0,
    )


@pytest.mark.parametrize("dag_id", sorted(NO_DATABASE))
def test_airflow_3_example_tasks_end_in_airflows_states(examples_folder: None, dag_id: str) -> None:
    airflows = AIRFLOW[dag_id]["tasks"]
    got = {
        task_id: _state(attempt.execute_attempt(_request(dag_id, task_id))) for task_id in airflows
    }
    assert got == airflows


def test_example_tasks_record_their_partitions_with_their_success(examples_folder: None) -> None:
    """A CronPartitionTimetable run's task gives its outlet's event the run's key; a task that
    adds partitions, one event per key."""
    hourly = attempt.execute_attempt(_request("ingest_team_a_player_stats", "ingest_team_a_stats"))
    assert isinstance(hourly, Succeeded)
    assert hourly.outlet_partitions == {"team_a_player_stats": ["2026-06-14T03:00:00"]}
    regions = attempt.execute_attempt(
        _request("multi_region_player_stats", "multi_region_player_stats")
    )
    assert isinstance(regions, Succeeded)
    assert regions.outlet_partitions == {"multi_region_player_stats": ["us", "eu", "apac"]}
