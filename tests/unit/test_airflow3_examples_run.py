"""Airflow 3's own example DAGs (tests/airflow_examples, as Airflow ships them) whose tasks need
no database, each task run in this process by worker.attempt under the import hook (the
folder's .deferral.toml turns it on), in the order `airflow dags test` runs them: each ends in
the state `airflow dags test` gives it. Those that read or write the database are run with
`deferral dags test` in tests/integration/test_airflow3_examples.py."""

from __future__ import annotations

import datetime as dt
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from cryptography.fernet import Fernet

from deferral.authoring import templating
from deferral.loading import task_runtime
from deferral.loading.dagbag import process_dagbag
from worker import attempt
from worker.outcomes import AttemptRequest, Failed, Skipped, Succeeded

EXAMPLES = Path(__file__).resolve().parents[1] / "airflow_examples"
S = "success"

# dag_id -> Airflow's task states (tasks listed upstream first). Every DAG of
# example_asset_partition.py is one task: what they show is that the partitioned
# timetables, mappers, windows and wait policies build, and a task reads its run's partition
# key and emits partitions at runtime.
AIRFLOW_ENDS: dict[str, dict[str, str]] = {
    "ingest_team_a_player_stats": {"ingest_team_a_stats": S},
    "team_b_player_stats": {"team_b_player_stats": S},
    "team_c_player_stats": {"team_c_player_stats": S},
    "clean_and_combine_player_stats": {"combine_player_stats": S},
    "compute_player_odds": {"compute_player_odds": S},
    "player_odds_quality_check_wont_ever_to_trigger": {"check_partition_alignment": S},
    "ingest_regional_sales": {"ingest_sales": S},
    "aggregate_regional_sales": {"aggregate_sales": S},
    "ingest_region_stats": {"ingest_region": S},
    "regional_stats_breakdown": {"regional_stats_breakdown": S},
    "live_region_player_stats": {"live_region_player_stats": S},
    "summarize_live_region_stats": {"summarize_live_region": S},
    "multi_region_player_stats": {"multi_region_player_stats": S},
    "daily_team_a_rollup": {"summarise_team_a_day": S},
    "monthly_team_a_rollup": {"summarise_team_a_month": S},
    "train_weekly_model": {"train_model": S},
    "daily_inference": {"run_inference": S},
    "trailing_week_inference": {"run_trailing_inference": S},
    "segment_region_stats_rollup": {"aggregate_all_regions": S},
    "segment_region_stats_early_rollup": {"aggregate_available_regions": S},
    "scatter_live_region_to_segments": {"process_region_segment": S},
    # example_asset_alias.py and example_asset_alias_with_no_taskflow.py (the alias's
    # consumers read the database: the integration test).
    "asset_s3_bucket_producer": {"produce_asset_events": S},
    "asset_s3_bucket_consumer": {"consume_asset_event": S},
    "asset_alias_example_alias_producer_with_no_taskflow": {
        "produce_asset_events_through_asset_alias_with_no_taskflow": S
    },
    "asset_s3_bucket_producer_with_no_taskflow": {"produce_asset_events": S},
    "asset_s3_bucket_consumer_with_no_taskflow": {"consume_asset_event": S},
    # example_external_task_marker_dag.py (its child waits on the parent's run: the
    # integration test).
    "example_external_task_marker_parent": {"parent_task": S},
    # example_asset_decorator.py (asset2_producer reads inlet events: the integration test).
    "asset1_producer": {"asset1_producer": S},
    "consumes_asset_decorator": {"process_nothing": S},
}


@pytest.fixture(scope="module")
def examples_folder() -> Iterator[None]:
    """worker.attempt reads the DAGs from the examples folder; settings point at servers never
    used (no task here reaches them)."""
    patch = pytest.MonkeyPatch()
    patch.setattr(sys, "path", list(sys.path))
    patch.setattr(templating, "record_rendered_fields", lambda *args: None)
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


@pytest.mark.parametrize("dag_id", sorted(AIRFLOW_ENDS))
def test_airflow_3_example_tasks_end_in_airflows_states(examples_folder: None, dag_id: str) -> None:
    got = {}
    for task_id in AIRFLOW_ENDS[dag_id]:
        request = AttemptRequest(
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
        got[task_id] = _state(attempt.execute_attempt(request))
    assert got == AIRFLOW_ENDS[dag_id]
