"""Airflow 3's own example DAGs, as Airflow ships them (tests/airflow_examples: copies of
apache-airflow's ``airflow/example_dags`` and apache-airflow-providers-standard's
``example_dags``, unchanged, with their licence header), run with `deferral dags test` under
the import hook (the folder's .deferral.toml turns it on): each ends with the task states and
run state `airflow dags test` gives."""

from __future__ import annotations

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

S, K, F = "success", "skipped", "failed"
# What a task's map indexes returned, where the values show what the run did.
RETURNED = {"example_task_group_mapping": ("op.mul_2", [4, 6, 8])}
# Run at now (`dags test` with no date): their start_date is after LOGICAL_DATE.
AT_NOW = {"example_task_state_store_mapped"}

# dag_id -> (Airflow's run state, Airflow's task states), for the DAGs run here (a run each:
# those whose runs show what the import hook's names do; every copy is checked loading in
# tests/unit/test_airflow_imports.py).
AIRFLOW_ENDS: dict[str, tuple[str, dict[str, str]]] = {
    # example_asset_alias.py: an event added through an alias, recorded with the success.
    "asset_alias_example_alias_producer": (S, {"produce_asset_events_through_asset_alias": S}),
    # example_asset_alias_with_no_taskflow.py: the events added through an alias, read.
    "asset_alias_example_alias_consumer_with_no_taskflow": (
        S,
        {"consume_asset_event_from_asset_alias": S},
    ),
    # example_task_state_store_mapped.py: each map index's own task state store.
    "example_task_state_store_mapped": (
        S,
        {"get_tables": S, "process_table[0]": S, "process_table[1]": S, "process_table[2]": S},
    ),
    # example_dynamic_task_mapping.py: a mapped task group.
    "example_task_group_mapping": (
        S,
        {f"op.{task}[{i}]": S for task in ("add_1", "mul_2") for i in range(3)},
    ),
    # example_asset_decorator.py: an @asset function reading another asset's events by name.
    "asset2_producer": (S, {"asset2_producer": S}),
    # example_outlet_event_extra.py: Metadata yielded, a post_execute hook.
    "asset_with_extra_by_yield": (S, {"asset_with_extra_by_yield": S}),
    "asset_with_extra_from_classic_operator": (
        S,
        {"asset_with_extra_from_classic_operator": S},
    ),
    # example_inlet_event_extra.py: inlets and inlet_events. The database has no event of the
    # asset, so the template's [-1] is undefined (Airflow's StrictUndefined fails it too).
    "read_asset_event_from_classic": (F, {"read_asset_event_from_classic": F}),
    "example_short_circuit_decorator": (
        S,
        {
            "condition_is_true": S,
            "true_1": S,
            "true_2": S,
            "condition_is_false": S,
            "false_1": K,
            "false_2": K,
            "task_1": S,
            "task_2": S,
            "short_circuit": S,
            "task_3": S,
            "task_4": K,  # only its direct downstream (ignore_downstream_trigger_rules=False)
            "task_5": S,
            "task_6": K,  # by its trigger rule
            "task_7": S,  # all_done
        },
    ),
}


@pytest.mark.parametrize("dag_id", sorted(AIRFLOW_ENDS))
def test_airflow_3_example_ends_in_airflows_states(
    dag_id: str, service_env: dict[str, str], sessions: sessionmaker[Session]
) -> None:
    env = {**os.environ, **service_env, "DEFERRAL_DAGS_FOLDER": str(EXAMPLES)}
    env.pop("DEFERRAL_AIRFLOW_IMPORTS", None)  # the folder's own setting decides
    date = [] if dag_id in AT_NOW else [LOGICAL_DATE]
    done = LANE.run(["dags", "test", dag_id, *date], env, TIMEOUT_SEC)
    run_state, task_states = AIRFLOW_ENDS[dag_id]
    with sessions() as session:
        (run,) = session.scalars(select(DagRun).where(DagRun.dag_id == dag_id)).all()
        got = {
            ti.task_id if ti.map_index < 0 else f"{ti.task_id}[{ti.map_index}]": ti.state
            for ti in session.scalars(select(TaskInstance).where(TaskInstance.dag_id == dag_id))
        }
    assert (run.state, got) == (run_state, task_states), done.stdout[-3000:] + done.stderr[-2000:]
    assert done.returncode == (0 if run_state == S else 1)
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
    assert got == {"child_task1": S, "child_task2": F, "child_task3": "upstream_failed"}, (
        done.stdout[-3000:] + done.stderr[-2000:]
    )
    assert done.returncode == 1
