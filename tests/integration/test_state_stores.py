"""Airflow 3.3's state stores against real PostgreSQL, through Airflow's own example DAGs
(tests/airflow_examples, unchanged) run in this process by worker.attempt: a task's keys outlive
its failed try and the retry reattaches (sync and async), an asset's keys outlive the run, and
bad keys and values are one-line errors."""

from __future__ import annotations

import datetime as dt
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from deferral.assets import Asset
from deferral.authoring import templating
from deferral.loading import task_runtime
from deferral.loading.dagbag import process_dagbag
from deferral.runtime.config import Settings
from deferral.store.state_stores import (
    NEVER_EXPIRE,
    AssetStateStores,
    StateStoreError,
    TaskStateStore,
)
from deferral.store.tables import TaskStateRow
from tests.integration.factories import running_task
from worker import attempt
from worker.outcomes import AttemptRequest, Failed, Outcome, Succeeded

EXAMPLES = Path(__file__).resolve().parents[1] / "airflow_examples"


@pytest.fixture
def examples(settings: Settings, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv("DEFERRAL_DAGS_FOLDER", str(EXAMPLES))
    monkeypatch.delenv("DEFERRAL_AIRFLOW_IMPORTS", raising=False)
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setattr(templating, "record_rendered_fields", lambda *args: None)
    monkeypatch.setattr(task_runtime, "parsed_fileloc", lambda dag_id: None)
    process_dagbag.cache_clear()
    yield
    process_dagbag.cache_clear()


def run(ti: int, dag_id: str, task_id: str, try_number: int) -> Outcome:
    return attempt.execute_attempt(
        AttemptRequest(
            task_instance_id=ti,
            dag_id=dag_id,
            run_id="r1",
            task_id=task_id,
            map_index=-1,
            try_number=try_number,
            logical_date=dt.datetime(2026, 6, 1, tzinfo=dt.UTC),
            conf={},
            first_started_at=dt.datetime.now(dt.UTC),
            next_method=None,
            next_kwargs=None,
            max_tries=2,
        )
    )


def test_a_retry_reattaches_to_the_job_its_failed_try_stored(
    examples: None, sessions: sessionmaker[Session]
) -> None:
    ti = running_task(sessions, "run_job")
    first = run(ti, "example_task_state_store", "run_job", 1)
    assert isinstance(first, Failed) and "Simulated failure after submitting job-" in first.error
    second = run(ti, "example_task_state_store", "run_job", 2)
    assert isinstance(second, Succeeded) and 100 <= second.return_value <= 10_000
    with sessions() as session:
        rows = {r.key: r for r in session.scalars(select(TaskStateRow))}
    assert sorted(rows) == ["job_id", "result", "status", "submitted_at"]
    assert rows["job_id"].expires_at is None  # NEVER_EXPIRE
    assert rows["submitted_at"].expires_at is not None  # the default retention
    assert rows["status"].value == "complete"
    assert rows["result"].value["job_id"] == rows["job_id"].value


def test_an_async_task_resumes_from_its_checkpoint(
    examples: None, sessions: sessionmaker[Session]
) -> None:
    ti = running_task(sessions, "ingest_pages")
    first = run(ti, "example_task_state_store_async", "ingest_pages", 1)
    assert isinstance(first, Failed) and "Staged worker loss after 8 pages" in first.error
    second = run(ti, "example_task_state_store_async", "ingest_pages", 2)
    assert second == Succeeded({"pages": 12, "rows": 7800})


def test_an_assets_keys_outlive_the_run(examples: None, sessions: sessionmaker[Session]) -> None:
    for run_id in ("r1", "r2"):
        ti = running_task(sessions, "load", run_id)
        assert isinstance(run(ti, "example_asset_state_store_producer", "load", 1), Succeeded)
    orders = AssetStateStores([Asset(name="orders/daily", uri="s3://warehouse/orders/daily")])
    assert orders.get("total_runs") == 2
    assert orders["orders/daily"].get("last_run_summary")["rows_loaded"] >= 100
    ti = running_task(sessions, "consume", "r3")
    assert isinstance(run(ti, "example_asset_state_store_consumer", "consume", 1), Succeeded)


def test_state_store_keys_and_values_are_checked(
    settings: Settings, sessions: sessionmaker[Session]
) -> None:
    store = TaskStateStore(running_task(sessions, "t"))
    store.set("k", {"a": 1}, retention=NEVER_EXPIRE)
    store.set("gone", 1, retention=dt.timedelta(0))
    assert (store.get("k"), store.get("gone", "expired"), store.get("none")) == (
        {"a": 1},
        "expired",
        None,
    )
    store.delete("k")
    assert store.get("k") is None
    with pytest.raises(StateStoreError, match="cannot set 'k' to None"):
        store.set("k", None)
    with pytest.raises(StateStoreError, match="the value of 'k' is not JSON"):
        store.set("k", object())
    with pytest.raises(StateStoreError, match="a key is a string of 1 to 512 characters"):
        store.get("")
    two = AssetStateStores([Asset("a"), Asset("b")])
    with pytest.raises(KeyError, match="the task has 2 assets"):
        two.get("k")
    with pytest.raises(KeyError, match="'c' is not an inlet or outlet of this task"):
        two["c"]
