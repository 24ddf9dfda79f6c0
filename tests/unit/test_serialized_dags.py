"""The serializer of the DAG store (``deferral.store.serialized_dags``): a DAG object becomes the
document the web UI and the CLI read, and back, with nothing a page needs left behind and a
secret-looking param default masked as the trigger form masks it."""

from __future__ import annotations

import datetime as dt
import json
import re

import pytest

from deferral import DAG
from deferral.authoring.setup_teardown import clearing_with
from deferral.exceptions import ActionError
from deferral.models.param import Param
from deferral.operators import EmptyOperator
from deferral.runtime.secrets_masker import MASK
from deferral.sensors.external_task import ExternalTaskMarker
from deferral.sensors.time_delta import TimeDeltaSensor
from deferral.store.actions import check_conf
from deferral.store.serialized_dags import StoredDag, StoredMarker, dag_hash, serialize_dag
from deferral.utils.edgemodifier import Label
from deferral.utils.task_group import TaskGroup


def _dag() -> DAG:
    with DAG(
        "stored",
        schedule="@daily",
        start_date=dt.datetime(2024, 1, 1, tzinfo=dt.UTC),
        tags=["etl", "daily"],
        doc_md="# Stored",
        dag_display_name="Stored DAG",
        params={
            "count": Param(3, type="integer", minimum=1, description="how many"),
            "password": "hunter2-secret",
            "needed": Param(type="string"),
        },
    ) as dag:
        setup = EmptyOperator(task_id="setup").as_setup()
        with TaskGroup("section"):
            work = EmptyOperator(task_id="work", retries=2, pool="small", doc_md="does work")
        each = TimeDeltaSensor.partial(task_id="each").expand(delta=[dt.timedelta(1)] * 3)
        setup >> Label("then") >> work >> each
    return dag


def test_a_dag_becomes_the_document_pages_read_and_back() -> None:
    stored = serialize_dag(_dag())
    assert (stored.dag_id, stored.display_name, stored.schedule) == (
        "stored",
        "Stored DAG",
        "@daily",
    )
    assert stored.tags == ["etl", "daily"] and stored.doc_md == "# Stored"
    assert stored.order == ["setup", "section.work", "each"]
    work = stored.task_dict["section.work"]
    assert (work.operator, work.groups, work.upstream, work.downstream) == (
        "EmptyOperator",
        ["section"],
        ["setup"],
        ["each"],
    )
    assert (work.retries, work.pool, work.docs, work.trigger_rule) == (
        2,
        "small",
        {"doc_md": "does work"},
        "all_success",
    )
    assert stored.task_dict["setup"].is_setup
    each = stored.task_dict["each"]
    assert each.is_mapped and each.mapping is not None and each.mapping.literal_length == 3
    assert stored.edge_labels == [("setup", "section.work", "then")]
    params = {param.name: param for param in stored.params}
    assert params["count"].value == 3 and params["count"].schema["minimum"] == 1
    assert params["password"].value == MASK  # as the trigger form shows it
    assert not params["needed"].has_value
    document = json.loads(json.dumps(stored.document()))  # JSON-able, as JSONB keeps it
    assert StoredDag.from_document(document) == stored
    assert "hunter2-secret" not in json.dumps(document)


def test_the_hash_changes_only_with_the_document() -> None:
    first, again = serialize_dag(_dag()).document(), serialize_dag(_dag()).document()
    assert dag_hash(first) == dag_hash(again)
    assert dag_hash(first) != dag_hash({**first, "tags": ["etl"]})


def _stored(dag: DAG) -> StoredDag:
    return StoredDag.from_document(json.loads(json.dumps(serialize_dag(dag).document())))


def test_a_trigger_checks_conf_against_the_stored_params_without_their_defaults() -> None:
    with DAG(
        "params",
        params={
            "count": Param(3, type="integer", minimum=1),
            # Masked in the document: its default must not be checked against its schema.
            "password": Param("hunter2-long-secret", type="string", minLength=12),
            "needed": Param(type="string"),
        },
    ) as dag:
        EmptyOperator(task_id="a")
    params = _stored(dag).params
    assert next(p for p in params if p.name == "password").value == MASK
    check_conf("params", params, {"needed": "x"})
    check_conf("params", params, {"needed": "x", "count": 2, "password": "another-long-one"})
    for conf, said in (
        ({"needed": "x", "count": 0}, "DAG 'params': param 'count': 0 is invalid"),
        ({}, "DAG 'params': param 'needed' has no value and no default"),
        ({"needed": 1}, "DAG 'params': param 'needed': 1 is invalid: 1 is not of type 'string'"),
        ({"needed": "x", "password": "short"}, "param 'password': 'short' is invalid"),
    ):
        with pytest.raises(ActionError, match=re.escape(said)):
            check_conf("params", params, conf)


def test_clear_trigger_and_next_run_read_the_same_graph_and_schedule_from_the_document() -> None:
    with DAG(
        "graph",
        schedule="@daily",
        start_date=dt.datetime(2024, 1, 1, tzinfo=dt.UTC),
        end_date=dt.datetime(2025, 1, 1, tzinfo=dt.UTC),
        catchup=True,
    ) as dag:
        setup = EmptyOperator(task_id="setup").as_setup()
        work = EmptyOperator(task_id="work", retries=2)
        teardown = EmptyOperator(task_id="teardown").as_teardown(setups=setup)
        marker = ExternalTaskMarker(
            task_id="marker", external_dag_id="other", external_task_id="t", recursion_depth=3
        )
        setup >> work >> teardown
        work >> marker
    stored = _stored(dag)
    for task_ids, downstream in ((["work"], False), (["work"], True), (["setup"], False)):
        assert clearing_with(stored, task_ids, downstream=downstream) == clearing_with(
            dag, task_ids, downstream=downstream
        )
    assert stored.downstream_of("setup") == dag.downstream_of("setup")
    assert stored.task_dict["work"].retries == 2
    assert (
        stored.marker_of("marker")
        == dag.marker_of("marker")
        == StoredMarker("other", "t", "{{ logical_date.isoformat() }}", 3)
    )
    assert stored.marker_of("work") is None
    at = dt.datetime(2024, 3, 5, 10, tzinfo=dt.UTC)
    assert stored.infer_manual_data_interval(at) == dag.infer_manual_data_interval(at)
    for last in (None, dag.infer_manual_data_interval(at)):
        assert stored.next_dagrun_info(last, now=at) == dag.next_dagrun_info(last, now=at)
