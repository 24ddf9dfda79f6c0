"""Airflow 3's outlet event extras, run by worker.attempt: a task annotates the asset event its
success records by yielding ``Metadata``, through ``context["outlet_events"]``, or in its
``post_execute`` hook; the extras travel in the Succeeded outcome."""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable
from pathlib import Path

import pytest

from deferral import DAG
from deferral.assets import (
    Asset,
    AssetAlias,
    AssetError,
    Metadata,
    OutletEventAccessors,
    collect_metadata,
)
from deferral.exceptions import DagDefinitionError
from deferral.operators import EmptyOperator
from worker.attempt import execute_attempt
from worker.outcomes import AttemptRequest, Failed, Succeeded

DAG_SOURCE = """
from deferral import DAG, task
from deferral.assets import Asset, Metadata
from deferral.operators import BashOperator, PythonOperator

report, other = Asset(uri="s3://out/report", name="report"), Asset("other")


def annotate(context, result):
    context["outlet_events"][report].extra = {"lines": result}


with DAG("outlets_dag"):

    @task(outlets=[report, other])
    def by_yield():
        yield Metadata(report, {"rows": 3})
        yield "ignored"
        return "done"

    @task(outlets=[report])
    def by_context(*, outlet_events=None):
        outlet_events["report"].extra["by"] = "context"

    @task(outlets=[report])
    def not_an_outlet(*, outlet_events=None):
        outlet_events[other].extra = {"x": 1}

    @task(outlets=[report])
    def unserializable(*, outlet_events=None):
        outlet_events[report].extra = {"x": object()}

    by_yield()
    by_context()
    not_an_outlet()
    unserializable()
    BashOperator(
        task_id="by_post_execute", outlets=[report], bash_command="echo 7", post_execute=annotate
    )
    PythonOperator(task_id="no_extras", outlets=[report], python_callable=lambda: None)
"""


@pytest.fixture(autouse=True)
def dag_file(attempt_dags: Callable[[str], Path]) -> None:
    attempt_dags(DAG_SOURCE)


def request(task_id: str) -> AttemptRequest:
    return AttemptRequest(
        task_instance_id=41,
        dag_id="outlets_dag",
        run_id="manual__1",
        task_id=task_id,
        map_index=-1,
        try_number=1,
        logical_date=dt.datetime(2024, 2, 3, tzinfo=dt.UTC),
        conf={},
        first_started_at=dt.datetime.now(dt.UTC),
        next_method=None,
        next_kwargs=None,
        max_tries=0,
    )


@pytest.mark.parametrize(
    ("task_id", "value", "extras"),
    [
        ("by_yield", "done", {"report": {"rows": 3}}),
        ("by_context", None, {"report": {"by": "context"}}),
        ("by_post_execute", "7", {"report": {"lines": "7"}}),
        ("no_extras", None, {}),
    ],
)
def test_a_task_annotates_its_outlet_events(
    task_id: str, value: object, extras: dict[str, object]
) -> None:
    outcome = execute_attempt(request(task_id))
    assert outcome == Succeeded(value, (), extras)


def test_an_asset_that_is_not_an_outlet_fails_the_task_naming_it() -> None:
    outcome = execute_attempt(request("not_an_outlet"))
    assert isinstance(outcome, Failed)
    assert "'other' is not an outlet of this task (outlets: report)" in outcome.error


def test_an_extra_that_cannot_be_stored_fails_the_task_for_good() -> None:
    outcome = execute_attempt(request("unserializable"))
    assert isinstance(outcome, Failed) and not outcome.allow_retry
    assert "outlet event extras of task 'unserializable'" in outcome.error


def test_metadata_and_accessors_check_their_input() -> None:
    report = Asset("report")
    with pytest.raises(AssetError, match="Metadata takes an Asset, got str"):
        Metadata("report", {})  # type: ignore[arg-type]
    with pytest.raises(AssetError, match="Metadata extra must be a dict, got list"):
        Metadata(report, [])  # type: ignore[arg-type]
    events = OutletEventAccessors([report])
    assert list(events) == ["report"] and events.extras() == {}

    def yields() -> object:
        yield Metadata(report, {"a": 1})
        yield Metadata(report, {"b": 2})
        return 5

    assert collect_metadata(yields(), events) == 5  # type: ignore[arg-type]
    assert events.extras() == {"report": {"a": 1, "b": 2}}
    assert events[report].asset is report and events["report"].extra == {"a": 1, "b": 2}


def test_inlets_take_assets_only() -> None:
    with DAG("d"), pytest.raises(AssetError, match=r"task 't': inlets must be Asset, got str"):
        EmptyOperator(task_id="t", inlets=["dataset"])


def test_post_execute_must_be_callable() -> None:
    with DAG("d"), pytest.raises(DagDefinitionError, match="post_execute must be callable"):
        EmptyOperator(task_id="t", post_execute="not a function")


def test_a_task_adds_events_of_any_asset_through_an_alias_in_its_outlets() -> None:
    alias, report = AssetAlias("found"), Asset("s3://b/report")
    events = OutletEventAccessors([alias, Asset("a")])
    events[AssetAlias("found")].add(report, extra={"rows": 1})
    events[alias].add(Asset("other", uri="file:///other"))
    assert events.alias_events() == [
        {
            "alias": "found",
            "name": report.name,
            "uri": report.uri,
            "group": "asset",
            "extra": {"rows": 1},
        },
        {"alias": "found", "name": "other", "uri": "file:///other", "group": "asset", "extra": {}},
    ]
    with pytest.raises(AssetError, match="alias 'found': add takes an Asset, got 's3://x'"):
        events[alias].add("s3://x")  # type: ignore[arg-type]
    with pytest.raises(AssetError, match="alias 'found': add takes an Asset"):
        events[alias].add(Asset.ref(name="x"))
    with pytest.raises(KeyError, match=r"AssetAlias\(name='other'\) is not an outlet"):
        events[AssetAlias("other")]


def test_a_dag_scheduled_on_an_alias_waits_for_its_key() -> None:
    alias = AssetAlias("found")
    condition = alias | Asset("a")
    assert list(condition.iter_keys()) == ["alias:found", "a"]
    assert not alias.evaluate({"found"}) and alias.evaluate({"alias:found"})
    with DAG("on_alias", schedule=[alias]) as dag:
        EmptyOperator(task_id="t", inlets=[alias], outlets=[alias])
    assert dag.asset_condition is not None and dag.timetable.summary == "alias:found"
    with pytest.raises(AssetError, match="asset alias name must be a non-empty string"):
        AssetAlias("")


def test_metadata_with_an_alias_adds_an_event_through_it() -> None:
    alias, found = AssetAlias("found"), Asset("found-1")
    events = OutletEventAccessors([alias])

    def yields() -> object:
        yield Metadata(found, {"rows": 2}, alias=alias)

    collect_metadata(yields(), events)  # type: ignore[arg-type]
    assert [(e["name"], e["extra"]) for e in events.alias_events()] == [("found-1", {"rows": 2})]
    with pytest.raises(AssetError, match="Metadata alias must be an AssetAlias, got str"):
        Metadata(found, {}, alias="found")  # type: ignore[arg-type]
