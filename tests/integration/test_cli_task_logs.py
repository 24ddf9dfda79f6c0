"""``deferral tasks logs``: a try's lines in order, --try, --map-index, the cut marker,
--follow until the try ends, and one line for whatever names nothing."""

from __future__ import annotations

import datetime as dt
import os
import subprocess
import threading

import pytest
from click.testing import CliRunner
from sqlalchemy import select, update
from sqlalchemy.orm import Session, sessionmaker

from deferral.runtime.config import Settings
from deferral.store import tasklogs, transitions
from deferral.store.tables import DagRun, TaskInstance
from deferral.store.tasklogs import NewLine
from deferral.store.transitions import Attempt, NewTaskInstance
from deferral_cli import main as deferral_main
from tests.e2e.conftest import command
from tests.helpers import wait_for
from tests.integration.factories import DAG_ID, WORKER, running_task

AT = dt.datetime(2024, 5, 1, 12, 0, 0, 250000, tzinfo=dt.UTC)


def _write(
    sessions: sessionmaker[Session],
    ti_id: int,
    *texts: str,
    try_number: int = 1,
    source: str = "task",
    max_bytes: int = 10_000,
) -> None:
    with sessions.begin() as session:
        lines = [NewLine(ti_id, try_number, AT, source, text) for text in texts]
        tasklogs.append(session, lines, max_bytes)


def _mapped_run(sessions: sessionmaker[Session], *map_indexes: int) -> dict[int, int]:
    """Run r1 of DAG "mapped" with these map indexes of task "m"; their task instance ids."""
    with sessions.begin() as session:
        transitions.create_dag_run(session, "mapped", "r1", dt.datetime.now(dt.UTC), {})
        run = session.scalars(select(DagRun)).one()
        tasks = [NewTaskInstance("m", 0, "default_pool", 1, "default", 1, i) for i in map_indexes]
        transitions.start_dag_run(session, run, tasks)
        session.flush()
        return {ti.map_index: ti.id for ti in session.scalars(select(TaskInstance))}


def _logs(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(deferral_main, ["tasks", "logs", *args])
    return result.exit_code, result.stdout, result.stderr


def test_the_latest_try_by_default_and_another_with_try(
    settings: Settings, sessions: sessionmaker[Session]
) -> None:
    ti_id = running_task(sessions)
    _write(sessions, ti_id, "first try")
    _write(sessions, ti_id, "failed, now up_for_retry", source="worker")
    with sessions.begin() as session:
        session.execute(update(TaskInstance).values(try_number=2))
    _write(sessions, ti_id, "second try", try_number=2)

    code, out, _ = _logs(DAG_ID, "r1", "t")
    assert code == 0
    assert out.splitlines() == [
        f"# {DAG_ID}.r1.t try 2",
        "2024-05-01T12:00:00.250Z task      second try",
    ]
    code, out, _ = _logs(DAG_ID, "r1", "t", "--try", "1")
    assert out.splitlines()[1:] == [
        "2024-05-01T12:00:00.250Z task      first try",
        "2024-05-01T12:00:00.250Z worker    failed, now up_for_retry",
    ]


def test_a_try_cut_at_the_bound_shows_the_marker(
    settings: Settings, sessions: sessionmaker[Session]
) -> None:
    ti_id = running_task(sessions)
    _write(sessions, ti_id, "a" * 40, "b" * 40, "c", max_bytes=64)

    code, out, _ = _logs(DAG_ID, "r1", "t")
    assert code == 0
    shown = out.splitlines()[1:]
    assert shown[0].endswith("task      " + "a" * 40)
    assert shown[1].endswith("cut       " + tasklogs.cut_marker(64))
    assert len(shown) == 2


def test_a_map_index_is_chosen_with_map_index(
    settings: Settings, sessions: sessionmaker[Session]
) -> None:
    ti_ids = _mapped_run(sessions, 0, 1)
    with sessions.begin() as session:
        session.execute(update(TaskInstance).values(try_number=1))
    _write(sessions, ti_ids[1], "index one")

    code, out, _ = _logs("mapped", "r1", "m", "--map-index", "1")
    assert code == 0
    assert out.splitlines()[0] == "# mapped.r1.m[1] try 1"
    assert out.splitlines()[1].endswith("index one")


@pytest.mark.parametrize(
    ("args", "error"),
    [
        (("nodag", "r1", "t"), "DAG 'nodag' has no run 'r1'"),
        ((DAG_ID, "r9", "t"), f"DAG '{DAG_ID}' has no run 'r9'"),
        ((DAG_ID, "r1", "nope"), f"run 'r1' of DAG '{DAG_ID}' has no task 'nope'"),
        (
            (DAG_ID, "r1", "t", "--try", "3"),
            f"{DAG_ID}.r1.t has no try 3 (tries 1 to 1; with logs: 1)",
        ),
        ((DAG_ID, "r1", "t", "--map-index", "2"), "task 't' of run 'r1' has no map index 2"),
        ((DAG_ID, "r1", "fresh"), f"{DAG_ID}.r1.fresh has not started a try yet"),
    ],
)
def test_what_names_nothing_is_one_line_and_exit_1(
    settings: Settings, sessions: sessionmaker[Session], args: tuple[str, ...], error: str
) -> None:
    ti_id = running_task(sessions)
    _write(sessions, ti_id, "something")
    with sessions.begin() as session:
        run = session.scalars(select(DagRun)).one()
        transitions.add_task_instances(
            session, run, [NewTaskInstance("fresh", 0, "default_pool", 1, "default", 1)]
        )

    code, out, err = _logs(*args)
    assert code == 1
    assert err == f"error: {error}\n"
    assert out == ""


def test_a_mapped_task_needs_its_map_index(
    settings: Settings, sessions: sessionmaker[Session]
) -> None:
    _mapped_run(sessions, 0)

    code, _, err = _logs("mapped", "r1", "m")
    assert code == 1
    assert err == "error: task 'm' is mapped: show one map index with --map-index N\n"


def test_follow_shows_new_lines_until_the_try_ends(
    service_env: dict[str, str], settings: Settings, sessions: sessionmaker[Session]
) -> None:
    ti_id = running_task(sessions)
    _write(sessions, ti_id, "working")
    follower = subprocess.Popen(
        command("deferral", "tasks", "logs", DAG_ID, "r1", "t", "--follow"),
        env={**os.environ, **service_env},
        stdout=subprocess.PIPE,
        text=True,
    )
    shown: list[str] = []
    reader = threading.Thread(target=lambda: shown.extend(follower.stdout or []), daemon=True)
    try:
        reader.start()
        wait_for(lambda: any("working" in line for line in shown), timeout=30)
        assert follower.poll() is None  # the try goes on: so does --follow

        with sessions.begin() as session:
            transitions.fail(session, Attempt(ti_id, 1, WORKER), "boom", allow_retry=False)
            tasklogs.append(session, [NewLine(ti_id, 1, AT, "worker", "failed, now failed")], 99)

        assert follower.wait(timeout=30) == 0
        reader.join(timeout=10)
    finally:
        if follower.poll() is None:
            follower.kill()
            follower.wait()
    assert [line.rstrip("\n").split(" ", 1)[-1] for line in shown[1:-1]] == [
        "task      working",
        "worker    failed, now failed",
    ]
    assert shown[-1] == "# try 1 is over; the task is failed at try 1\n"
