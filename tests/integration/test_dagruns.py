"""scheduler.dagruns against real Postgres: dag rows, scheduled runs exactly once, max_active_runs,
dagrun_timeout."""

from __future__ import annotations

import datetime as dt
import os
import threading
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select, text
from sqlalchemy.dialects import postgresql
from sqlalchemy.orm import Session, sessionmaker

from deferral.loading.dagbag import DagBag
from deferral.runtime.config import Settings
from deferral.runtime.crypto import Cipher, Purpose
from deferral.states import DagRunState, DagRunType, TaskState
from deferral.store import transitions
from deferral.store.tables import (
    Dag,
    DagImportError,
    DagRun,
    TaskInstance,
    TaskStateChange,
    Trigger,
)
from deferral.store.transitions import Attempt, NewDagRun, NewTaskInstance
from scheduler import dagruns, dags

WriteDag = Callable[[str, str], Path]
UTC = dt.UTC
NOW = dt.datetime(2024, 1, 10, 12, tzinfo=UTC)
DAY = dt.timedelta(days=1)


def dag_source(dag_id: str, **arguments: Any) -> str:
    settings = {"schedule": "@daily", "start_date": dt.datetime(2024, 1, 7, tzinfo=UTC)}
    settings.update(arguments)
    spelled = ", ".join(f"{name}={value!r}" for name, value in settings.items())
    return f"""
import datetime
from deferral import DAG
from deferral.operators import EmptyOperator

with DAG({dag_id!r}, {spelled}) as dag:
    EmptyOperator(task_id="a") >> EmptyOperator(task_id="b")
"""


@pytest.fixture
def new_dag(settings: Settings, write_dag: WriteDag) -> Callable[..., str]:
    def write(**arguments: Any) -> str:
        dag_id = f"sched_{uuid.uuid4().hex[:8]}"
        write_dag(dag_id, dag_source(dag_id, **arguments))
        return dag_id

    return write


def parsed(settings: Settings) -> DagBag:
    return DagBag(settings.dags_folder).collect()


def sync(sessions: sessionmaker[Session], bag: DagBag, now: dt.datetime = NOW) -> None:
    """What the scheduler does after each parse."""
    with sessions.begin() as session:
        dagruns.sync_dags(session, bag, now)
        dags.sync(session, bag)


def create(sessions: sessionmaker[Session], bag: DagBag, now: dt.datetime = NOW) -> list[str]:
    with sessions.begin() as session:
        return [r.run_id for r in dagruns.create_due_runs(session, bag.dags, now)]


def dag_row(sessions: sessionmaker[Session], dag_id: str) -> Dag:
    with sessions() as session:
        row = session.get(Dag, dag_id)
        assert row is not None
        return row


def runs_of(sessions: sessionmaker[Session], dag_id: str) -> list[DagRun]:
    with sessions() as session:
        return list(
            session.scalars(
                select(DagRun).where(DagRun.dag_id == dag_id).order_by(DagRun.logical_date)
            )
        )


def day(n: int) -> dt.datetime:
    return dt.datetime(2024, 1, n, tzinfo=UTC)


# -- sync_dags -----------------------------------------------------------------------------------


def test_sync_writes_a_row_per_dag_with_its_next_run(
    settings: Settings, sessions: sessionmaker[Session], new_dag: Callable[..., str]
) -> None:
    dag_id = new_dag(catchup=True, max_active_runs=3)
    sync(sessions, parsed(settings))
    row = dag_row(sessions, dag_id)
    assert (row.is_paused, row.is_active, row.schedule, row.max_active_runs) == (
        False,
        True,
        "@daily",
        3,
    )
    assert (row.next_dagrun, row.next_dagrun_data_interval_end) == (day(7), day(8))
    assert row.next_dagrun_create_after == day(8)
    assert row.last_parsed_at is not None and row.missing_since is None


def test_sync_stores_the_tags_of_each_parse(
    settings: Settings, sessions: sessionmaker[Session], write_dag: WriteDag
) -> None:
    dag_id = f"sched_{uuid.uuid4().hex[:8]}"
    path = write_dag(dag_id, dag_source(dag_id, tags=["etl", "daily"]))
    sync(sessions, parsed(settings))
    assert dag_row(sessions, dag_id).tags == ["etl", "daily"]
    path.write_text(dag_source(dag_id, tags=["ml"]))
    os.utime(path, (path.stat().st_atime, path.stat().st_mtime + 5))
    sync(sessions, parsed(settings))
    assert dag_row(sessions, dag_id).tags == ["ml"]


def test_paused_upon_creation_applies_once_then_users_decide(
    settings: Settings, sessions: sessionmaker[Session], new_dag: Callable[..., str]
) -> None:
    dag_id = new_dag(is_paused_upon_creation=True)
    sync(sessions, parsed(settings))
    assert dag_row(sessions, dag_id).is_paused is True
    with sessions.begin() as session:
        session.execute(text("UPDATE dag SET is_paused = false WHERE dag_id = :d"), {"d": dag_id})
    sync(sessions, parsed(settings))
    assert dag_row(sessions, dag_id).is_paused is False


def test_import_errors_follow_the_files_and_their_dags_are_missing_meanwhile(
    settings: Settings, sessions: sessionmaker[Session], write_dag: WriteDag
) -> None:
    dag_id = f"sched_{uuid.uuid4().hex[:8]}"
    path = write_dag(dag_id, dag_source(dag_id))
    bag = DagBag(settings.dags_folder)
    sync(sessions, bag.collect())

    path.write_text("raise RuntimeError('boom')\n")
    sync(sessions, bag.collect(), NOW)
    first = dag_row(sessions, dag_id).missing_since
    sync(sessions, bag.collect(), NOW + DAY)
    with sessions() as session:
        error = session.get(DagImportError, str(path))
        assert error is not None
        assert error.error == "RuntimeError: boom (line 1)"
        assert error.first_seen < error.last_seen
    row = dag_row(sessions, dag_id)
    # Still active (its file is there), missing since the first parse that failed.
    assert (row.is_active, row.missing_reason) == (True, "RuntimeError: boom (line 1)")
    assert row.missing_since is not None and row.missing_since == first

    path.write_text(dag_source(dag_id))
    sync(sessions, bag.collect(), NOW + 2 * DAY)
    with sessions() as session:
        assert session.get(DagImportError, str(path)) is None
    row = dag_row(sessions, dag_id)
    assert (row.missing_since, row.missing_reason) == (None, None)


def test_a_dag_no_file_defines_any_more_is_deactivated_and_comes_back(
    settings: Settings, sessions: sessionmaker[Session], write_dag: WriteDag
) -> None:
    dag_id = f"sched_{uuid.uuid4().hex[:8]}"
    path = write_dag(dag_id, dag_source(dag_id))
    bag = DagBag(settings.dags_folder)
    sync(sessions, bag.collect())

    path.write_text("x = 1\n")
    sync(sessions, bag.collect(), NOW + DAY)
    row = dag_row(sessions, dag_id)
    assert (row.is_active, row.missing_since) == (False, NOW + DAY)
    assert row.missing_reason == f"no longer defined in {path}"

    path.write_text(dag_source(dag_id))
    sync(sessions, bag.collect(), NOW + 2 * DAY)
    row = dag_row(sessions, dag_id)
    assert (row.is_active, row.missing_since, row.missing_reason) == (True, None, None)


# -- create_due_runs -------------------------------------------------------------------------------


def test_catchup_creates_every_missed_interval_once_with_its_data_interval(
    settings: Settings, sessions: sessionmaker[Session], new_dag: Callable[..., str]
) -> None:
    dag_id = new_dag(catchup=True)
    bag = parsed(settings)
    sync(sessions, bag)
    created = create(sessions, bag)
    assert created == [f"scheduled__{day(n).isoformat()}" for n in (7, 8, 9)]
    runs = runs_of(sessions, dag_id)
    assert [(r.logical_date, r.data_interval_start, r.data_interval_end) for r in runs] == [
        (day(n), day(n), day(n + 1)) for n in (7, 8, 9)
    ]
    assert {(r.run_type, r.state) for r in runs} == {("scheduled", "queued")}
    row = dag_row(sessions, dag_id)
    assert (row.next_dagrun, row.next_dagrun_create_after) == (day(10), day(11))

    assert create(sessions, bag) == []  # nothing more is due until the 11th
    assert create(sessions, bag, day(11)) == [f"scheduled__{day(10).isoformat()}"]


def test_without_catchup_only_the_latest_interval_runs(
    settings: Settings, sessions: sessionmaker[Session], new_dag: Callable[..., str]
) -> None:
    dag_id = new_dag(start_date=dt.datetime(2023, 6, 1, tzinfo=UTC))
    bag = parsed(settings)
    sync(sessions, bag)
    assert create(sessions, bag) == [f"scheduled__{day(9).isoformat()}"]
    assert [r.data_interval_end for r in runs_of(sessions, dag_id)] == [day(10)]


def test_paused_and_missing_dags_get_no_runs(
    settings: Settings, sessions: sessionmaker[Session], new_dag: Callable[..., str]
) -> None:
    new_dag(is_paused_upon_creation=True, catchup=True)
    missing = new_dag(catchup=True)
    bag = parsed(settings)
    sync(sessions, bag)
    with sessions.begin() as session:
        session.execute(
            text("UPDATE dag SET missing_since = now() WHERE dag_id = :d"), {"d": missing}
        )
    assert create(sessions, bag) == []


def test_max_active_runs_holds_the_next_runs_until_runs_finish(
    settings: Settings, sessions: sessionmaker[Session], new_dag: Callable[..., str]
) -> None:
    dag_id = new_dag(catchup=True, max_active_runs=2)
    bag = parsed(settings)
    sync(sessions, bag)
    assert len(create(sessions, bag)) == 2
    assert create(sessions, bag) == []  # two active: held
    with sessions.begin() as session:
        first = session.scalars(select(DagRun).where(DagRun.dag_id == dag_id)).first()
        assert first is not None
        transitions.finish_dag_run(session, first, DagRunState.SUCCESS)
    assert create(sessions, bag) == [f"scheduled__{day(9).isoformat()}"]


def test_the_due_query_reads_the_index_on_dag(sessions: sessionmaker[Session]) -> None:
    """Cheap whatever the number of DAGs: the due DAGs come from ix_dag_next_dagrun_create_after
    (sequential scans are turned off so that the tiny test table does not hide the plan)."""
    query = dagruns.due_dags_query(NOW, 100).compile(
        dialect=postgresql.dialect(), compile_kwargs={"literal_binds": True}
    )
    with sessions.begin() as session:
        session.execute(text("SET LOCAL enable_seqscan = off"))
        plan = "\n".join(session.scalars(text(f"EXPLAIN {query}")))
    assert "ix_dag_next_dagrun_create_after" in plan, plan


def test_two_replicas_racing_create_each_run_exactly_once(
    settings: Settings, sessions: sessionmaker[Session], new_dag: Callable[..., str]
) -> None:
    dag_ids = [new_dag(catchup=True) for _ in range(5)]
    bag = parsed(settings)
    sync(sessions, bag)
    barrier = threading.Barrier(2)
    errors: list[BaseException] = []

    def replica() -> None:
        try:
            for minutes in range(0, 24 * 60 * 4, 90):  # four days of loops, racing each time
                barrier.wait(timeout=30)
                create(sessions, bag, day(10) + dt.timedelta(minutes=minutes))
        except BaseException as exc:
            errors.append(exc)
            barrier.abort()

    threads = [threading.Thread(target=replica) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    for dag_id in dag_ids:
        assert [r.logical_date for r in runs_of(sessions, dag_id)] == [day(n) for n in range(7, 13)]


def test_the_unique_key_alone_keeps_a_second_insert_from_creating_a_run(
    sessions: sessionmaker[Session],
) -> None:
    """Two transactions insert the same scheduled run at once (as replicas whose view of the dag
    row is stale would): the second waits for the first and then creates nothing."""
    run = NewDagRun("racing", DagRunType.SCHEDULED, day(7), day(7), day(8))
    first = sessions()
    first.begin()
    assert transitions.create_dag_runs_once(first, [run]) == [run.run_id]
    outcome: list[list[str]] = []

    def second() -> None:
        with sessions.begin() as session:
            outcome.append(transitions.create_dag_runs_once(session, [run]))

    thread = threading.Thread(target=second)
    thread.start()
    thread.join(timeout=1.0)
    assert thread.is_alive()  # blocked on the first insert's key
    first.commit()
    first.close()
    thread.join(timeout=30)
    assert outcome == [[]]
    # A manual run at the same logical date is refused too (Airflow 2's key covers every run).
    backfill = NewDagRun("racing", DagRunType.BACKFILL, day(7), day(7), day(8))
    with sessions.begin() as session:
        assert transitions.create_dag_runs_once(session, [backfill]) == []
    assert len(runs_of(sessions, "racing")) == 1


def test_a_catch_up_of_20000_minutes_is_created_in_one_call(
    sessions: sessionmaker[Session],
) -> None:
    """A minutely DAG caught up over 20,000 minutes: every run created by one call, with its
    conf, dates and partition key (a VALUES list of nine parameters a run went past
    PostgreSQL's 65,535 bound parameters at 7,282 runs)."""
    start = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
    minute = dt.timedelta(minutes=1)
    runs = [
        NewDagRun(
            "minutely",
            DagRunType.SCHEDULED,
            start + n * minute,
            start + n * minute,
            start + (n + 1) * minute,
            conf={"n": n} if n == 7 else {},
            partition_key="p" if n == 7 else None,
        )
        for n in range(20_000)
    ]
    with sessions.begin() as session:
        created = transitions.create_dag_runs_once(session, runs)
    assert sorted(created) == sorted(run.run_id for run in runs)
    with sessions.begin() as session:  # created once: a second call creates none
        assert transitions.create_dag_runs_once(session, runs[:10]) == []
    with sessions() as session:
        seventh = session.scalars(select(DagRun).where(DagRun.run_id == runs[7].run_id)).one()
        assert (seventh.conf, seventh.partition_key, seventh.state) == ({"n": 7}, "p", "queued")
        assert (seventh.data_interval_start, seventh.data_interval_end) == (
            runs[7].data_interval_start,
            runs[7].data_interval_end,
        )
        assert seventh.evaluate_after is not None and seventh.run_type == "scheduled"


# -- startable_runs -----------------------------------------------------------------------------


def queue_runs(
    sessions: sessionmaker[Session], dag_id: str, days: list[int], run_type: DagRunType
) -> None:
    with sessions.begin() as session:
        transitions.create_dag_runs_once(
            session, [NewDagRun(dag_id, run_type, day(n), day(n), day(n + 1)) for n in days]
        )


def start(sessions: sessionmaker[Session], limit: int = 50) -> list[str]:
    with sessions.begin() as session:
        runs = dagruns.startable_runs(session, limit)
        for run in runs:
            transitions.start_dag_run(session, run, [])
        return [f"{run.dag_id}/{run.logical_date.day}" for run in runs]


def test_queued_runs_start_oldest_first_within_max_active_runs(
    settings: Settings, sessions: sessionmaker[Session], new_dag: Callable[..., str]
) -> None:
    one = new_dag(max_active_runs=1)
    two = new_dag(max_active_runs=2)
    sync(sessions, parsed(settings))
    queue_runs(sessions, one, [3, 1, 2], DagRunType.BACKFILL)
    queue_runs(sessions, two, [1, 2, 3], DagRunType.MANUAL)
    assert sorted(start(sessions)) == sorted([f"{one}/1", f"{two}/1", f"{two}/2"])
    assert start(sessions) == []


def test_a_paused_dag_starts_only_its_backfill_runs(
    settings: Settings, sessions: sessionmaker[Session], new_dag: Callable[..., str]
) -> None:
    dag_id = new_dag(is_paused_upon_creation=True)
    sync(sessions, parsed(settings))
    queue_runs(sessions, dag_id, [1], DagRunType.MANUAL)
    queue_runs(sessions, dag_id, [2], DagRunType.BACKFILL)
    assert start(sessions) == [f"{dag_id}/2"]


def test_runs_of_a_dag_without_a_row_yet_start(sessions: sessionmaker[Session]) -> None:
    queue_runs(sessions, "unsynced", [1], DagRunType.MANUAL)
    assert start(sessions) == ["unsynced/1"]


def test_replicas_never_start_more_than_max_active_runs_together(
    settings: Settings, sessions: sessionmaker[Session], new_dag: Callable[..., str]
) -> None:
    dag_id = new_dag(max_active_runs=1)
    sync(sessions, parsed(settings))
    queue_runs(sessions, dag_id, [1, 2, 3], DagRunType.BACKFILL)
    first = sessions()
    first.begin()
    taken = dagruns.startable_runs(first, 50)
    assert [r.logical_date for r in taken] == [day(1)]
    # While the first replica holds the DAG row, the second starts nothing of that DAG.
    assert start(sessions) == []
    transitions.start_dag_run(first, taken[0], [])
    first.commit()
    first.close()
    assert start(sessions) == []


# -- fail_timed_out_runs -------------------------------------------------------------------------


def test_a_run_past_dagrun_timeout_fails_and_its_unfinished_tasks_are_skipped(
    settings: Settings,
    sessions: sessionmaker[Session],
    cipher: Cipher,
    new_dag: Callable[..., str],
) -> None:
    dag_id = new_dag(schedule=None, dagrun_timeout=dt.timedelta(minutes=30))
    bag = parsed(settings)
    with sessions.begin() as session:
        for run_id in ("old", "young"):
            transitions.create_dag_run(session, dag_id, run_id, dt.datetime.now(UTC), {})
            run = session.scalars(select(DagRun).where(DagRun.run_id == run_id)).one()
            tasks = [NewTaskInstance(t, 0, "default_pool", 1, "default", 1) for t in "abc"]
            transitions.start_dag_run(session, run, tasks)
        session.flush()
        session.execute(
            text("UPDATE dag_run SET start_date = now() - interval '1 hour' WHERE run_id = 'old'")
        )
        ids = {
            (ti.run_id, ti.task_id): ti.id
            for ti in session.scalars(select(TaskInstance).where(TaskInstance.dag_id == dag_id))
        }
        # old: a succeeded, b deferred on a trigger, c not started
        a, b = ids[("old", "a")], ids[("old", "b")]
        transitions.schedule(session, [a, b])
        transitions.dispatch(session, [a, b])
        assert len(transitions.start_many(session, [(a, 1), (b, 1)], "host", "w")) == 2
        transitions.succeed(session, Attempt(a, 1, "w"), None)
        trigger_id = transitions.create_trigger(
            session, "x.Trigger", cipher.seal(Purpose.TRIGGER_KWARGS, {})
        )
        transitions.defer(
            session,
            Attempt(b, 1, "w"),
            trigger_id=trigger_id,
            next_method="resume",
            next_kwargs_token=cipher.seal(Purpose.RESUME_KWARGS, {}),
            trigger_timeout=None,
        )

    with sessions.begin() as session:
        failed = dagruns.fail_timed_out_runs(session, bag.dags, dt.datetime.now(UTC))
    assert failed == [(dag_id, "old")]
    with sessions() as session:
        states = {(ti.run_id, ti.task_id): ti.state for ti in session.scalars(select(TaskInstance))}
        assert session.get(Trigger, trigger_id) is None
        reasons = set(
            session.scalars(
                select(TaskStateChange.reason).where(TaskStateChange.to_state == "skipped")
            )
        )
        run_states = {
            r.run_id: r.state for r in session.execute(select(DagRun.run_id, DagRun.state))
        }
    assert states == {
        ("old", "a"): TaskState.SUCCESS,
        ("old", "b"): TaskState.SKIPPED,
        ("old", "c"): TaskState.SKIPPED,
        ("young", "a"): TaskState.NONE,
        ("young", "b"): TaskState.NONE,
        ("young", "c"): TaskState.NONE,
    }
    assert reasons == {transitions.DAGRUN_TIMED_OUT}
    assert run_states == {"old": DagRunState.FAILED, "young": DagRunState.RUNNING}
    with sessions.begin() as session:  # once only
        assert dagruns.fail_timed_out_runs(session, bag.dags, dt.datetime.now(UTC)) == []


# -- fail_broken_runs ----------------------------------------------------------------------------


def test_runs_of_a_dag_that_stopped_loading_fail_a_bounded_number_per_call(
    sessions: sessionmaker[Session], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(dags, "BROKEN_RUNS_PER_CALL", 2)
    with sessions.begin() as session:
        session.execute(
            text(
                "INSERT INTO dag (dag_id, missing_since, missing_reason)"
                " VALUES ('broken', now() - interval '1 hour', 'gone')"
            )
        )
        session.execute(
            text(
                "INSERT INTO dag_run (dag_id, run_id, logical_date, state)"
                " SELECT 'broken', 'r' || n, now() - n * interval '1 s', 'running'"
                " FROM generate_series(1, 3) AS n"
            )
        )
    failed = []
    for _ in range(2):
        with sessions.begin() as session:
            failed.append(len(dags.fail_broken_runs(session, dt.timedelta(minutes=1))))
    assert failed == [2, 1]
