"""Dynamic task mapping in the scheduler against real Postgres: a mapped task's placeholder
expanded into map indexes once, from literals or from an upstream XCom's shape; empty, bad and
too long inputs; trigger rules and outcomes over map indexes; a cleared mapped task revised."""

from __future__ import annotations

import dataclasses
import datetime as dt
import threading
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

from broker.client import Broker
from deferral.runtime.config import Settings
from deferral.store import transitions
from deferral.store.tables import DagRun, TaskInstance, TaskStateChange
from deferral.store.transitions import NewTaskInstance
from deferral_cli import main as deferral_main
from scheduler.service import SchedulerService
from tests.integration.factories import finish_queued
from tests.servers import REDIS_URL

WriteDag = Callable[[str, str], Path]


def _dag_file(dag_id: str, body: str) -> str:
    return f"""
from deferral import DAG, task
from deferral.operators import BashOperator, EmptyOperator, PythonOperator

with DAG("{dag_id}") as dag:
{body}
"""


@pytest.fixture
def dag_id() -> str:
    return f"map_{uuid.uuid4().hex[:8]}"


def _scheduler(settings: Settings) -> SchedulerService:
    service = SchedulerService(settings, name=f"s{uuid.uuid4().hex[:4]}")
    service.attach(Broker.from_url(REDIS_URL, settings.stream_prefix))
    service.refresh_dags()  # a running scheduler reads the folder off its loop
    return service


def _step(service: SchedulerService) -> None:
    service.start_queued_runs()
    service.evaluate_marked_runs()
    service.dispatch_scheduled()


def _trigger(sessions: sessionmaker[Session], dag_id: str) -> None:
    with sessions.begin() as session:
        transitions.create_dag_run(session, dag_id, "r1", dt.datetime.now(dt.UTC), {})


def _states(sessions: sessionmaker[Session]) -> dict[str, str]:
    """task or task[map_index] -> state."""
    with sessions() as session:
        return {
            ti.task_id if ti.map_index < 0 else f"{ti.task_id}[{ti.map_index}]": ti.state
            for ti in session.scalars(select(TaskInstance))
        }


def _run_state(sessions: sessionmaker[Session]) -> str:
    with sessions() as session:
        return session.scalars(select(DagRun.state)).one()


def _reason(sessions: sessionmaker[Session], task_id: str, map_index: int = -1) -> str:
    with sessions() as session:
        return (
            session.scalars(
                select(TaskStateChange.reason)
                .join(TaskInstance, TaskInstance.id == TaskStateChange.task_instance_id)
                .where(TaskInstance.task_id == task_id, TaskInstance.map_index == map_index)
                .order_by(TaskStateChange.id.desc())
            ).first()
            or ""
        )


def _finish(
    sessions: sessionmaker[Session],
    task_id: str,
    map_index: int = -1,
    *,
    value: Any = None,
    ok: bool = True,
    skip: bool = False,
) -> None:
    """What a worker does with the queued attempt of one task instance."""
    where = (TaskInstance.task_id == task_id, TaskInstance.map_index == map_index)
    finish_queued(sessions, *where, value=value, ok=ok, skip=skip)


def test_literal_mapping_expands_into_map_indexes_and_the_reduce_waits_for_all(
    settings: Settings, sessions: sessionmaker[Session], write_dag: WriteDag, dag_id: str
) -> None:
    body = """
    mapped = BashOperator.partial(task_id="m", retries=2).expand(bash_command=["a", "b", "c"])
    mapped >> EmptyOperator(task_id="after")
"""
    write_dag(dag_id, _dag_file(dag_id, body))
    service = _scheduler(settings)
    _trigger(sessions, dag_id)
    _step(service)
    assert _states(sessions) == {
        "m[0]": "queued",
        "m[1]": "queued",
        "m[2]": "queued",
        "after": "none",
    }
    with sessions() as session:
        tis = session.scalars(select(TaskInstance).where(TaskInstance.task_id == "m")).all()
        assert {ti.max_tries for ti in tis} == {2}  # the partial() settings of every map index
    assert _reason(sessions, "m", 0) == "dispatched"
    for index in (0, 1):
        _finish(sessions, "m", index)
    _step(service)
    assert _states(sessions)["after"] == "none"  # waits for every map index
    _finish(sessions, "m", 2)
    _step(service)
    assert _states(sessions)["after"] == "queued"


def test_xcom_mapping_expands_once_the_upstream_pushed_its_list(
    settings: Settings, sessions: sessionmaker[Session], write_dag: WriteDag, dag_id: str
) -> None:
    body = """
    @task
    def numbers():
        return [1, 2]

    @task
    def double(x):
        return 2 * x

    @task
    def total(values):
        return sum(values)

    total(double.expand(x=numbers()))
"""
    write_dag(dag_id, _dag_file(dag_id, body))
    service = _scheduler(settings)
    _trigger(sessions, dag_id)
    _step(service)
    assert _states(sessions) == {"numbers": "queued", "double": "none", "total": "none"}
    _finish(sessions, "numbers", value=[1, 2])
    _step(service)
    assert _states(sessions) == {
        "numbers": "success",
        "double[0]": "queued",
        "double[1]": "queued",
        "total": "none",
    }
    with sessions() as session:
        reasons = session.scalars(
            select(TaskStateChange.reason)
            .join(TaskInstance, TaskInstance.id == TaskStateChange.task_instance_id)
            .where(TaskInstance.task_id == "double", TaskInstance.map_index == 0)
            .order_by(TaskStateChange.id)
        ).all()
    assert reasons[0] == "expanded into 2 task instance(s), map indexes 0 to 1"
    for index in (0, 1):
        _finish(sessions, "double", index, value=index)
    _step(service)
    assert _states(sessions)["total"] == "queued"


@pytest.mark.parametrize(
    ("pushed", "why"),
    [
        (
            5,
            "cannot map argument 'bash_command' over the XCom 'return_value' of task 'up':"
            " it is an int",
        ),
        (None, "it is nothing (no value was pushed), not a list or dict"),
        ("abc", "it is a str, not a list or dict"),
    ],
)
def test_an_input_that_cannot_be_mapped_fails_the_mapped_task_naming_the_argument(
    settings: Settings,
    sessions: sessionmaker[Session],
    write_dag: WriteDag,
    dag_id: str,
    pushed: Any,
    why: str,
) -> None:
    body = """
    up = PythonOperator(task_id="up", python_callable=lambda: 5)
    mapped = BashOperator.partial(task_id="m").expand(bash_command=up.output, env=[{}])
    mapped >> EmptyOperator(task_id="after")
    EmptyOperator(task_id="other")
"""
    write_dag(dag_id, _dag_file(dag_id, body))
    service = _scheduler(settings)
    _trigger(sessions, dag_id)
    _step(service)
    _finish(sessions, "up", value=pushed)
    _finish(sessions, "other")
    _step(service)
    assert _states(sessions) == {
        "up": "success",
        "m": "failed",
        "after": "upstream_failed",
        "other": "success",
    }
    assert why in _reason(sessions, "m")
    assert _reason(sessions, "m").startswith("task 'm'")
    assert _run_state(sessions) == "failed"


def test_an_empty_input_skips_the_mapped_task_and_trigger_rules_carry_the_skip(
    settings: Settings, sessions: sessionmaker[Session], write_dag: WriteDag, dag_id: str
) -> None:
    body = """
    up = PythonOperator(task_id="up", python_callable=list)
    mapped = BashOperator.partial(task_id="m").expand(bash_command=up.output)
    mapped >> EmptyOperator(task_id="after")
    mapped >> EmptyOperator(task_id="cleanup", trigger_rule="all_done")
"""
    write_dag(dag_id, _dag_file(dag_id, body))
    service = _scheduler(settings)
    _trigger(sessions, dag_id)
    _step(service)
    _finish(sessions, "up", value=[])
    _step(service)
    assert _states(sessions) == {
        "up": "success",
        "m": "skipped",
        "after": "skipped",
        "cleanup": "queued",
    }
    assert _reason(sessions, "m").startswith("nothing to map over")
    _finish(sessions, "cleanup")
    _step(service)
    assert _run_state(sessions) == "success"


def test_more_values_than_max_map_length_fail_the_mapped_task(
    settings: Settings, sessions: sessionmaker[Session], write_dag: WriteDag, dag_id: str
) -> None:
    body = """
    up = PythonOperator(task_id="up", python_callable=list)
    BashOperator.partial(task_id="m").expand(bash_command=up.output, cwd=["/a", "/b"])
"""
    write_dag(dag_id, _dag_file(dag_id, body))
    service = _scheduler(dataclasses.replace(settings, max_map_length=5))
    _trigger(sessions, dag_id)
    _step(service)
    _finish(sessions, "up", value=["x", "y", "z"])
    _step(service)
    assert _states(sessions)["m"] == "failed"
    assert _reason(sessions, "m") == (
        "task 'm' would expand into 6 task instances, more than DEFERRAL_MAX_MAP_LENGTH (5)"
    )


def test_a_skipped_task_mapped_over_skips_the_mapped_task_whatever_its_trigger_rule(
    settings: Settings, sessions: sessionmaker[Session], write_dag: WriteDag, dag_id: str
) -> None:
    body = """
    up = PythonOperator(task_id="up", python_callable=list)
    side = EmptyOperator(task_id="side")
    mapped = BashOperator.partial(task_id="m", trigger_rule="all_done").expand(
        bash_command=up.output
    )
    side >> mapped
"""
    write_dag(dag_id, _dag_file(dag_id, body))
    service = _scheduler(settings)
    _trigger(sessions, dag_id)
    _step(service)
    _finish(sessions, "up", skip=True)
    _step(service)
    # Skipped at once, as Airflow's MappedTaskUpstreamDep, though "side" still runs.
    assert _states(sessions) == {"up": "skipped", "side": "queued", "m": "skipped"}
    assert _reason(sessions, "m") == "a task it maps over was skipped"


def test_trigger_rules_count_every_map_index(
    settings: Settings, sessions: sessionmaker[Session], write_dag: WriteDag, dag_id: str
) -> None:
    body = """
    mapped = BashOperator.partial(task_id="m").expand(bash_command=["a", "b"])
    mapped >> EmptyOperator(task_id="all_ok")
    mapped >> EmptyOperator(task_id="any_ok", trigger_rule="one_success")
    mapped >> EmptyOperator(task_id="any_failed", trigger_rule="one_failed")
"""
    write_dag(dag_id, _dag_file(dag_id, body))
    service = _scheduler(settings)
    _trigger(sessions, dag_id)
    _step(service)
    _finish(sessions, "m", 0)
    _step(service)
    assert _states(sessions)["any_ok"] == "queued"
    assert _states(sessions)["all_ok"] == "none"
    _finish(sessions, "m", 1, ok=False)
    _step(service)
    states = _states(sessions)
    assert (states["all_ok"], states["any_failed"]) == ("upstream_failed", "queued")
    _finish(sessions, "any_ok")
    _finish(sessions, "any_failed")
    _step(service)
    # A leaf's failure is every map index's: all_ok is upstream_failed, so the run failed.
    assert _run_state(sessions) == "failed"


def test_a_mapped_leaf_with_a_failed_map_index_fails_the_run(
    settings: Settings, sessions: sessionmaker[Session], write_dag: WriteDag, dag_id: str
) -> None:
    body = """
    BashOperator.partial(task_id="m").expand(bash_command=["a", "b"])
"""
    write_dag(dag_id, _dag_file(dag_id, body))
    service = _scheduler(settings)
    _trigger(sessions, dag_id)
    _step(service)
    _finish(sessions, "m", 0)
    _step(service)
    assert _run_state(sessions) == "running"
    _finish(sessions, "m", 1, ok=False)
    _step(service)
    assert _run_state(sessions) == "failed"


def test_a_cleared_mapped_task_follows_its_input_new_length(
    settings: Settings, sessions: sessionmaker[Session], write_dag: WriteDag, dag_id: str
) -> None:
    body = """
    up = PythonOperator(task_id="up", python_callable=list)
    BashOperator.partial(task_id="m").expand(bash_command=up.output)
"""
    write_dag(dag_id, _dag_file(dag_id, body))
    service = _scheduler(settings)
    _trigger(sessions, dag_id)
    _step(service)
    _finish(sessions, "up", value=["a", "b", "c"])
    _step(service)
    for index in range(3):
        _finish(sessions, "m", index)
    _step(service)
    assert _run_state(sessions) == "success"

    def clear_all() -> None:
        with sessions.begin() as session:
            run = session.scalars(select(DagRun)).one()
            for ti in session.scalars(select(TaskInstance)):
                assert transitions.clear(session, ti, retries=0)
            transitions.reopen_dag_run(session, run)

    clear_all()
    _step(service)
    _finish(sessions, "up", value=["a"])
    _step(service)
    assert _states(sessions) == {
        "up": "success",
        "m[0]": "queued",
        "m[1]": "removed",
        "m[2]": "removed",
    }
    assert (
        _reason(sessions, "m", 1) == "its input now gives 1 value(s): no value for this map index"
    )
    _finish(sessions, "m", 0)
    _step(service)
    assert _run_state(sessions) == "success"  # removed map indexes do not hold the run

    clear_all()
    _step(service)
    _finish(sessions, "up", value=["a", "b", "c", "d"])
    _step(service)
    # The removed map indexes were cleared too: all four run, the fourth created now.
    states = _states(sessions)
    assert [states[f"m[{i}]"] for i in range(4)] == ["queued"] * 4


def test_a_placeholder_is_expanded_at_most_once_by_racing_schedulers(
    settings: Settings, sessions: sessionmaker[Session], write_dag: WriteDag, dag_id: str
) -> None:
    """Two transactions expand the same placeholder at the same moment: the one that moves it
    second (after the first commits) finds it expanded and creates nothing."""
    body = """
    BashOperator.partial(task_id="m").expand(bash_command=["a"])
"""
    write_dag(dag_id, _dag_file(dag_id, body))
    with sessions.begin() as session:
        run_pk = transitions.create_dag_run(session, dag_id, "r1", dt.datetime.now(dt.UTC), {})
        run = session.get(DagRun, run_pk)
        assert run is not None
        transitions.add_task_instances(session, run, [_new("m", -1)])
    with sessions() as session:
        placeholder = session.scalars(select(TaskInstance.id)).one()

    more = [_new("m", 1), _new("m", 2)]
    first = sessions()
    first.begin()
    run_first = first.get(DagRun, run_pk)
    assert run_first is not None
    assert len(transitions.expand_mapped_task(first, run_first, placeholder, more)) == 3
    second_result: list[Any] = []

    def second() -> None:
        with sessions.begin() as session:
            run = session.get(DagRun, run_pk)
            assert run is not None
            second_result.append(transitions.expand_mapped_task(session, run, placeholder, more))

    racer = threading.Thread(target=second)
    racer.start()
    racer.join(timeout=1)
    assert racer.is_alive()  # blocked on the placeholder's row lock
    first.commit()
    first.close()
    racer.join(timeout=30)
    assert second_result == [[]]
    with sessions() as session:
        count = session.scalar(select(func.count()).select_from(TaskInstance))
        changes = session.scalar(select(func.count()).select_from(TaskStateChange))
    assert (count, changes) == (3, 1)


def _new(task_id: str, map_index: int) -> NewTaskInstance:
    return NewTaskInstance(task_id, 0, "default_pool", 1, "default", 1, map_index)


def _cli(*args: str) -> tuple[int, list[str]]:
    result = CliRunner().invoke(deferral_main, list(args))
    return result.exit_code, result.output.splitlines()


def test_commands_show_and_select_map_indexes(
    settings: Settings, sessions: sessionmaker[Session], write_dag: WriteDag, dag_id: str
) -> None:
    body = """
    up = PythonOperator(task_id="up", python_callable=list)
    mapped = BashOperator.partial(task_id="m").expand(bash_command=up.output)
    mapped >> EmptyOperator(task_id="after")
"""
    write_dag(dag_id, _dag_file(dag_id, body))
    service = _scheduler(settings)
    _trigger(sessions, dag_id)
    _step(service)
    code, lines = _cli("tasks", "explain", dag_id, "r1", "m")
    assert code == 0, lines
    assert lines[:3] == [
        f"{dag_id}.r1.m: none (try 0 of at most 1)",
        "  mapped task, not expanded yet: expand(bash_command=XComArg('up', key='return_value'))",
        "  it expands into one task instance per value once up finished and its trigger rule"
        " lets it run",
    ]
    code, lines = _cli("tasks", "render", dag_id, "r1", "m")
    assert (code, lines[-1]) == (
        1,
        "error: task 'm' is mapped: show one map index with --map-index N",
    )
    _finish(sessions, "up", value=["echo {{ ti.map_index }}", "b", "c"])
    code, lines = _cli("tasks", "render", dag_id, "r1", "m", "--map-index", "0")
    assert code == 0 and "echo {{ ti.map_index }}" in lines  # pulled from XCom: not rendered
    _step(service)
    _finish(sessions, "m", 0)
    _finish(sessions, "m", 1, ok=False)

    code, lines = _cli("tasks", "list", "--dag-id", dag_id)
    assert code == 0
    # TASK_ID and MAP_INDEX columns.
    assert sorted(tuple(line.split()[2:4]) for line in lines[1:]) == [
        ("after", "-1"),
        ("m", "0"),
        ("m", "1"),
        ("m", "2"),
        ("up", "-1"),
    ]
    code, lines = _cli("runs", "show", dag_id, "r1")
    assert lines[1:] == [
        "  up: success (try 1)",
        "  m[0]: success (try 1)",
        "  m[1]: failed (try 1)",
        "  m[2]: queued (try 1)",
        "  after: none (try 0)",
    ]
    code, lines = _cli("tasks", "explain", dag_id, "r1", "after")
    assert "  upstream m: mapped, 3 map index(es): 1 failed, 1 queued, 1 success" in lines
    code, lines = _cli("tasks", "explain", dag_id, "r1", "m", "--map-index", "1")
    assert lines[0] == f"{dag_id}.r1.m[1]: failed (try 1 of at most 1)"
    assert not any(line.startswith(f"{dag_id}.r1.m[0]") for line in lines)

    code, lines = _cli("tasks", "clear", dag_id, "r1", "m", "--map-index", "1", "--map-index", "2")
    assert code == 1  # m[2] is queued: refused, m[1] cleared
    assert lines == ["m[1]: none", "error: not changed while queued or running: m[2] (queued)"]
    assert _states(sessions)["m[0]"] == "success"
    code, lines = _cli("tasks", "mark", dag_id, "r1", "m", "--map-index", "7", "--state", "success")
    assert (code, lines) == (1, ["error: task 'm' of run 'r1' has no map index 7"])
    _step(service)
    assert _states(sessions)["m[1]"] == "queued"  # the cleared map index runs again
