"""Airflow 3's own example DAGs, as Airflow ships them (tests/airflow_examples: copies of
apache-airflow's ``airflow/example_dags`` and apache-airflow-providers-standard's
``example_dags``, unchanged, with their licence header), run with `deferral dags test` under
the import hook (the folder's .deferral.toml turns it on): each ends with the task states and
run state `airflow dags test` gives."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from deferral.store.tables import DagRun, TaskInstance, XCom
from tests.forks import LANE

EXAMPLES = Path(__file__).resolve().parents[1] / "airflow_examples"
TIMEOUT_SEC = 180
# A Monday: no example branches on the day it runs.
LOGICAL_DATE = "2024-05-06T12:00:00+00:00"

S = "success"
# What `airflow dags test` gave each DAG (tests/airflow_examples/record_airflow_states.py):
# its logical date ("now" where its start_date is after 2024-05-06T12:00:00+00:00, the date of
# the others), its run's state and its tasks' (a map index's as task_id[i]).
AIRFLOW = json.loads((EXAMPLES / "airflow_states.json").read_text())["dags"]
# What a task's map indexes returned, where the values show what the run did.
RETURNED = {"example_task_group_mapping": ("op.mul_2", [4, 6, 8])}
# What a failed task's log says, where the cause is what the run shows.
FAILED_BECAUSE = {
    "read_asset_event": "Task has the following inactive assets in its inlets or outlets:"
    " Asset(name='s3://output/1.txt', uri='s3://output/1.txt')",
}

# The DAGs run here: those whose runs show what the import hook's names do on the database
# (every copy is checked loading in tests/unit/test_airflow_imports.py).
RUN_HERE = [
    # example_asset_alias.py: an event added through an alias, recorded with the success.
    "asset_alias_example_alias_producer",
    # example_asset_alias_with_no_taskflow.py: the events added through an alias, read.
    "asset_alias_example_alias_consumer_with_no_taskflow",
    # example_task_state_store_mapped.py: each map index's own task state store.
    "example_task_state_store_mapped",
    # example_dynamic_task_mapping.py: a mapped task group.
    "example_task_group_mapping",
    # example_asset_decorator.py: an @asset function reading another asset's events by name.
    "asset2_producer",
    # example_outlet_event_extra.py: Metadata yielded, a post_execute hook.
    "asset_with_extra_by_yield",
    "asset_with_extra_from_classic_operator",
    # example_inlet_event_extra.py: inlets and inlet_events. Its Asset("s3://output/1.txt") is
    # inactive: example_outlet_event_extra.py's Asset(name="test-asset"), of a DAG id before
    # its, took the URI first; both tasks fail before they run, as Airflow's.
    "read_asset_event",
    "read_asset_event_from_classic",
    # example_short_circuit_decorator.py: task_4 skipped as the only direct downstream
    # (ignore_downstream_trigger_rules=False), task_6 by its trigger rule, task_7 all_done.
    "example_short_circuit_decorator",
]


def _airflows(dag_id: str) -> tuple[str, dict[str, str]]:
    return AIRFLOW[dag_id]["state"], AIRFLOW[dag_id]["tasks"]


@pytest.mark.parametrize("dag_id", sorted(RUN_HERE))
def test_airflow_3_example_ends_in_airflows_states(
    dag_id: str, service_env: dict[str, str], sessions: sessionmaker[Session]
) -> None:
    env = {**os.environ, **service_env, "DEFERRAL_DAGS_FOLDER": str(EXAMPLES)}
    env.pop("DEFERRAL_AIRFLOW_IMPORTS", None)  # the folder's own setting decides
    date = AIRFLOW[dag_id]["logical_date"]
    done = LANE.run(["dags", "test", dag_id, *([] if date == "now" else [date])], env, TIMEOUT_SEC)
    run_state, task_states = _airflows(dag_id)
    with sessions() as session:
        (run,) = session.scalars(select(DagRun).where(DagRun.dag_id == dag_id)).all()
        got = {
            ti.task_id if ti.map_index < 0 else f"{ti.task_id}[{ti.map_index}]": ti.state
            for ti in session.scalars(select(TaskInstance).where(TaskInstance.dag_id == dag_id))
        }
    assert (run.state, got) == (run_state, task_states), done.stdout[-3000:] + done.stderr[-2000:]
    assert done.returncode == (0 if run_state == S else 1)
    if dag_id in FAILED_BECAUSE:
        assert FAILED_BECAUSE[dag_id] in done.stdout, done.stdout[-3000:]
    if dag_id in RETURNED:
        task_id, values = RETURNED[dag_id]
        with sessions() as session:
            pulled = session.execute(
                select(TaskInstance.map_index, XCom.value)
                .join(XCom, XCom.task_instance_id == TaskInstance.id)
                .where(TaskInstance.dag_id == dag_id, TaskInstance.task_id == task_id)
                .order_by(TaskInstance.map_index)
            ).all()
        assert [value for _, value in pulled] == values


def test_a_run_before_the_dags_start_date_creates_no_task_and_succeeds(
    service_env: dict[str, str], sessions: sessionmaker[Session]
) -> None:
    """example_task_state_store_mapped.py starts in 2026: `airflow dags test` at an earlier
    logical date creates none of its tasks (``verify_integrity``), and the run succeeds."""
    dag_id = "example_task_state_store_mapped"
    env = {**os.environ, **service_env, "DEFERRAL_DAGS_FOLDER": str(EXAMPLES)}
    env.pop("DEFERRAL_AIRFLOW_IMPORTS", None)
    done = LANE.run(["dags", "test", dag_id, LOGICAL_DATE], env, TIMEOUT_SEC)
    with sessions() as session:
        (run,) = session.scalars(select(DagRun).where(DagRun.dag_id == dag_id)).all()
        tis = session.scalars(select(TaskInstance).where(TaskInstance.dag_id == dag_id)).all()
    assert (run.state, tis) == (S, []), done.stdout[-3000:] + done.stderr[-2000:]
    assert done.returncode == 0


def test_a_sensor_on_a_task_group_that_does_not_exist_fails_at_once(
    service_env: dict[str, str], sessions: sessionmaker[Session]
) -> None:
    """example_external_task_marker_dag.py: with the parent's run at the same logical date,
    the child's first sensor finds its task; the second waits on a task group the parent does
    not have, which Airflow 3 fails at once (its API answers 404)."""
    env = {**os.environ, **service_env, "DEFERRAL_DAGS_FOLDER": str(EXAMPLES)}
    env.pop("DEFERRAL_AIRFLOW_IMPORTS", None)
    for dag_id in ("example_external_task_marker_parent", "example_external_task_marker_child"):
        done = LANE.run(["dags", "test", dag_id, LOGICAL_DATE], env, TIMEOUT_SEC)
    with sessions() as session:
        got = {
            ti.task_id: ti.state
            for ti in session.scalars(
                select(TaskInstance).where(
                    TaskInstance.dag_id == "example_external_task_marker_child"
                )
            )
        }
    run_state, task_states = _airflows("example_external_task_marker_child")
    assert got == task_states, done.stdout[-3000:] + done.stderr[-2000:]
    assert done.returncode == (0 if run_state == S else 1)
