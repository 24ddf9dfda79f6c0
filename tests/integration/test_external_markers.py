"""A clear with downstream follows ExternalTaskMarkers (actions.change_tasks, real PostgreSQL):
the marked task and its downstream tasks in the other DAG's run at the marker's (rendered)
logical date are cleared too; markers forming a cycle stop at recursion_depth, clearing
nothing; a marker naming a run that does not exist clears nothing there; the web UI's clear
follows markers through its own DAG bag."""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable
from pathlib import Path

import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker
from starlette.testclient import TestClient

from deferral import DAG
from deferral.loading.dagbag import DagBag
from deferral.operators import EmptyOperator
from deferral.runtime.config import Settings
from deferral.sensors.external_task import ExternalTaskMarker
from deferral.states import TaskState
from deferral.store import actions
from deferral.store.tables import TaskInstance
from tests.integration.conftest import WEB_ADMIN_PASSWORD as ADMIN_PASSWORD
from tests.integration.test_webserver import basic

DAY = dt.datetime(2024, 3, 1, tzinfo=dt.UTC)


def finished_run(sessions: sessionmaker[Session], dag: DAG, logical_date: dt.datetime) -> str:
    """A run of ``dag`` at ``logical_date`` whose tasks all succeeded."""
    triggered = actions.trigger_run(sessions, dag, {}, logical_date=logical_date)
    with sessions.begin() as session:
        for task_id in dag.task_dict:
            session.add(
                TaskInstance(
                    dag_id=dag.dag_id,
                    run_id=triggered.run_id,
                    task_id=task_id,
                    state=TaskState.SUCCESS,
                    try_number=1,
                )
            )
    return triggered.run_id


def states(sessions: sessionmaker[Session], dag_id: str) -> dict[str, str]:
    with sessions() as session:
        rows = session.execute(
            select(TaskInstance.task_id, TaskInstance.state).where(TaskInstance.dag_id == dag_id)
        ).all()
    return dict(rows)


def test_clear_downstream_follows_markers_into_the_other_run(
    sessions: sessionmaker[Session],
) -> None:
    with DAG("mk_parent") as parent:
        ExternalTaskMarker(
            task_id="marker",
            external_dag_id="mk_child",
            external_task_id="first",
            # Rendered in the parent run's context: the child run of the day before.
            logical_date="{{ macros.ds_add(ds, -1) }}T00:00:00+00:00",
        )
    with DAG("mk_child") as child:
        EmptyOperator(task_id="before")
        EmptyOperator(task_id="first") >> EmptyOperator(task_id="second")
    dags = {parent.dag_id: parent, child.dag_id: child}
    run_id = finished_run(sessions, parent, DAY)
    finished_run(sessions, child, DAY - dt.timedelta(days=1))
    finished_run(sessions, child, DAY)  # not the marked date: left alone
    find_dag = dags.__getitem__
    # Marking, even with downstream, and clearing without it, do not follow the marker.
    mark = actions.mark_change("failed")
    actions.change_tasks(
        sessions, parent, run_id, "marker", mark, downstream=True, find_dag=find_dag
    )
    actions.change_tasks(
        sessions, parent, run_id, "marker", actions.clear_change, find_dag=find_dag
    )
    assert set(states(sessions, "mk_child").values()) == {TaskState.SUCCESS}

    done = actions.change_tasks(
        sessions,
        parent,
        run_id,
        "marker",
        actions.clear_change,
        downstream=True,
        find_dag=find_dag,
    )
    assert [label for label, _ in done.changed] == [
        "marker",
        "mk_child:first",
        "mk_child:second",
    ]
    with sessions() as session:
        cleared = session.execute(
            select(TaskInstance.run_id, TaskInstance.task_id)
            .where(TaskInstance.dag_id == "mk_child", TaskInstance.state != TaskState.SUCCESS)
            .order_by(TaskInstance.task_id)
        ).all()
    assert [task_id for _, task_id in cleared] == ["first", "second"]
    assert {run for run, _ in cleared} == {f"manual__{(DAY - dt.timedelta(days=1)).isoformat()}"}


@pytest.mark.parametrize("depth", [1, 2])
def test_markers_in_a_cycle_stop_at_recursion_depth_clearing_nothing(
    sessions: sessionmaker[Session], depth: int
) -> None:
    with DAG(f"cy_a{depth}") as a:
        ExternalTaskMarker(
            task_id="to_b",
            external_dag_id=f"cy_b{depth}",
            external_task_id="to_a",
            recursion_depth=depth,
        )
    with DAG(f"cy_b{depth}") as b:
        ExternalTaskMarker(task_id="to_a", external_dag_id=f"cy_a{depth}", external_task_id="to_b")
    dags = {a.dag_id: a, b.dag_id: b}
    run_id = finished_run(sessions, a, DAY)
    finished_run(sessions, b, DAY)
    with pytest.raises(actions.ActionError, match=f"maximum recursion depth {depth} reached"):
        actions.change_tasks(
            sessions,
            a,
            run_id,
            "to_b",
            actions.clear_change,
            downstream=True,
            find_dag=dags.__getitem__,
        )
    assert set(states(sessions, a.dag_id).values()) == {TaskState.SUCCESS}
    assert set(states(sessions, b.dag_id).values()) == {TaskState.SUCCESS}


def test_a_marker_whose_run_is_missing_clears_only_here(sessions: sessionmaker[Session]) -> None:
    with DAG("lone_parent") as parent:
        ExternalTaskMarker(task_id="m", external_dag_id="lone_child", external_task_id="t")
    with DAG("lone_child") as child:
        EmptyOperator(task_id="t")
    run_id = finished_run(sessions, parent, DAY)
    done = actions.change_tasks(
        sessions,
        parent,
        run_id,
        "m",
        actions.clear_change,
        downstream=True,
        find_dag={"lone_child": child}.__getitem__,
    )
    assert [label for label, _ in done.changed] == ["m"]


MARKER_FILE = """
from deferral import DAG
from deferral.operators import EmptyOperator
from deferral.sensors.external_task import ExternalTaskMarker

with DAG("web_parent"):
    ExternalTaskMarker(task_id="marker", external_dag_id="web_child", external_task_id="first")

with DAG("web_child"):
    EmptyOperator(task_id="first") >> EmptyOperator(task_id="second")
"""


def test_the_web_uis_clear_follows_markers_through_its_own_dags(
    local: TestClient,
    settings: Settings,
    sessions: sessionmaker[Session],
    write_dag: Callable[[str, str], Path],
) -> None:
    write_dag("web_markers", MARKER_FILE)
    bag = DagBag(settings.dags_folder).collect()
    run_id = finished_run(sessions, bag.get_dag("web_parent"), DAY)
    finished_run(sessions, bag.get_dag("web_child"), DAY)
    answer = local.post(
        "/api/v1/dags/web_parent/clear",
        json={"run_id": run_id, "task_id": "marker", "downstream": True},
        headers=basic("admin", ADMIN_PASSWORD),
    )
    assert answer.status_code == 200, answer.text
    assert [changed["task"] for changed in answer.json()["changed"]] == [
        "marker",
        "web_child:first",
        "web_child:second",
    ]
