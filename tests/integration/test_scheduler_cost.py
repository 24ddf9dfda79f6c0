"""A scheduler loop's work depends on what changed, not on how many runs merely wait: the SQL
statements of one loop that applies one fired event (and queues its task in that same loop) are
the same with 10 and with 2,000 runs whose tasks are all deferred, and a loop with nothing to do
is one statement."""

from __future__ import annotations

import datetime as dt
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import create_engine, event, select, text
from sqlalchemy.orm import Session, sessionmaker
from sqlalchemy.pool import NullPool

from broker.client import Broker
from deferral.runtime.config import Settings, load_settings
from deferral.runtime.crypto import Cipher
from deferral.store import statistics
from deferral.store.db import make_engine, make_sessionmaker
from deferral.store.tables import TaskInstance
from scheduler import dagruns, evaluation, housekeeping
from scheduler import service as scheduler_service
from scheduler.service import SchedulerService
from tests.conftest import fresh_database
from tests.helpers import wait_for
from tests.integration.factories import deferred_task
from tests.servers import REDIS_URL
from triggerer.events import event_message


def _idle_runs(sessions: sessionmaker[Session], first: int, count: int) -> None:
    """``count`` running runs (a logical date each), each with one task deferred on a
    far-future trigger, as they are after their last evaluation (not marked)."""
    with sessions.begin() as session:
        session.execute(
            text(
                """
                WITH runs AS (
                    INSERT INTO dag_run (dag_id, run_id, logical_date, state, start_date)
                    SELECT 'idle', 'idle_' || n, now() - n * interval '1 second', 'running', now()
                    FROM generate_series(:first, :first + :count - 1) AS n
                    RETURNING run_id
                ), triggers AS (
                    INSERT INTO trigger (classpath, kwargs)
                    SELECT 'deferral.triggers.temporal.DateTimeTrigger', run_id
                    FROM runs
                    RETURNING id, kwargs AS run_id
                )
                INSERT INTO task_instance (dag_id, run_id, task_id, state, try_number, trigger_id,
                                           next_method)
                SELECT 'idle', run_id, 'wait', 'deferred', 1, id, 'resume' FROM triggers
                """
            ),
            {"first": first, "count": count},
        )


def _loop_service(settings: Settings) -> SchedulerService:
    """A scheduler whose first loop (with its periodic work) has run: the next has none due."""
    service = SchedulerService(settings, name="cost")
    service.attach(Broker.from_url(REDIS_URL, settings.stream_prefix))
    service.consumer.start()
    service.refresh_dags()  # the DAGs there for its first loop, as a running scheduler has them
    service.step()
    assert service.parser.wait(60)  # the read of the folder that loop started, recorded
    service.record_parsed_dags()
    _none_due(service)
    return service


def _none_due(service: SchedulerService) -> None:
    """Put off every periodic pass of ``service`` for an hour: its next loop does only what
    Postgres and the streams ask."""
    later = time.monotonic() + 3600
    for periodic in service.periodic:
        periodic.due = later


def _statements_of(service: SchedulerService, step: Callable[[], object]) -> list[str]:
    statements: list[str] = []

    def count(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        statements.append(" ".join(statement.split()))

    event.listen(service.engine, "before_cursor_execute", count)
    try:
        step()
    finally:
        event.remove(service.engine, "before_cursor_execute", count)
    return statements


def _statements_of_one_loop(
    settings: Settings, sessions: sessionmaker[Session], cipher: Cipher, run_id: str
) -> tuple[int, str]:
    ti_id, trigger_id = deferred_task(sessions, cipher, run_id=run_id)
    with sessions.begin() as session:
        session.execute(text("UPDATE dag_run SET evaluate_after = NULL"))
    service = _loop_service(settings)
    service.broker.publish(
        service.keys.events, event_message(cipher, trigger_id, "fired", "triggerer")
    )
    statements = _statements_of(service, service.step)
    with sessions() as session:
        state = session.scalar(select(TaskInstance.state).where(TaskInstance.id == ti_id))
    service.broker.close()
    return len(statements), state or ""


def test_a_loop_with_nothing_to_do_is_one_statement_whatever_the_idle_runs(
    settings: Settings, sessions: sessionmaker[Session], monkeypatch: pytest.MonkeyPatch
) -> None:
    _idle_runs(sessions, first=1, count=2000)
    service = _loop_service(settings)
    monkeypatch.setattr(scheduler_service, "EVENT_BLOCK_MS", 1)  # no event comes

    (statement,) = _statements_of(service, service.step)
    assert statement.startswith("SELECT EXISTS")  # which passes have work: none

    with sessions.begin() as session:  # one run marked: evaluated, in the same loop
        session.execute(text("UPDATE dag_run SET evaluate_after = now() WHERE run_id = 'idle_7'"))
    assert len(_statements_of(service, service.step)) > 1
    with sessions() as session:
        marked = session.scalar(text("SELECT evaluate_after FROM dag_run WHERE run_id = 'idle_7'"))
    assert marked is None or marked > dt.datetime.now(dt.UTC)  # evaluated: not marked now
    service.broker.close()


def test_one_loop_costs_the_same_whatever_the_idle_runs(
    settings: Settings, sessions: sessionmaker[Session], cipher: Cipher, broker: Broker
) -> None:
    _idle_runs(sessions, first=1, count=10)
    few, state = _statements_of_one_loop(settings, sessions, cipher, run_id="with_10")
    assert state == "queued"  # resumed and queued in the same loop

    _idle_runs(sessions, first=11, count=1990)
    many, state = _statements_of_one_loop(settings, sessions, cipher, run_id="with_2000")
    assert state == "queued"

    assert 0 < few < 40
    assert many == few, f"{few} statements with 10 idle runs, {many} with 2,000"


# -- a run's cost per change does not grow with the run (scheduler/DECISIONS.md 12) -------------

SIZED_DAG = """
from deferral import DAG
from deferral.operators import EmptyOperator

with DAG("{dag_id}", max_active_tasks=100_000) as dag:
    for i in range({size}):
        EmptyOperator(task_id=f"t{{i}}")
"""


def _sized_run(sessions: sessionmaker[Session], dag_id: str, size: int) -> int:
    """A running run of ``size`` independent tasks as it is just after a success: t0 succeeded
    (the run is marked), t1 deferred on a trigger of its own, every other task deferred. Returns
    t1's trigger id."""
    with sessions.begin() as session:
        return int(
            session.scalar(
                text(
                    """
                    WITH run AS (
                        INSERT INTO dag_run (dag_id, run_id, logical_date, state, start_date,
                                             evaluate_after)
                        VALUES (:dag_id, 'r', now(), 'running', now(), now())
                    ), fires AS (
                        INSERT INTO trigger (classpath, kwargs)
                        VALUES ('deferral.triggers.temporal.DateTimeTrigger', 'sealed')
                        RETURNING id
                    ), tasks AS (
                        INSERT INTO task_instance (dag_id, run_id, task_id, state, try_number,
                                                   trigger_id, next_method, pool, queue)
                        SELECT :dag_id, 'r', 't' || n,
                               CASE WHEN n = 0 THEN 'success' ELSE 'deferred' END, 1,
                               CASE WHEN n = 1 THEN (SELECT id FROM fires) END,
                               CASE WHEN n > 0 THEN 'resume' END, 'default_pool', 'default'
                        FROM generate_series(0, :size - 1) AS n
                    )
                    SELECT id FROM fires
                    """
                ),
                {"dag_id": dag_id, "size": size},
            )
        )


def _quiet(engines: list[Any], stats: Any) -> None:
    """Close every connection to the test database, so that each backend reports its
    statistics as it exits, and wait until PostgreSQL's counts are settled."""
    for engine in engines:
        engine.dispose()
    with stats.connect() as conn:
        wait_for(
            lambda: (
                conn.scalar(
                    text(
                        "SELECT count(*) FROM pg_stat_activity"
                        " WHERE datname = current_database() AND pid <> pg_backend_pid()"
                    )
                )
                == 0
            ),
            timeout=30,
            what="the test database's other connections to close",
        )
    readings = [_tuples_read(stats)]

    def settled() -> bool:
        readings.append(_tuples_read(stats))
        return readings[-1] == readings[-2]

    wait_for(settled, timeout=30, interval=0.3, what="the statistics to settle")


def _tuples_read(stats: Any) -> int:
    """Rows PostgreSQL read for the test database's tables: by sequential scans, and index
    entries read by index scans (index-only scans included)."""
    with stats.connect() as conn:
        return int(
            conn.scalar(
                text(
                    "SELECT (SELECT coalesce(sum(seq_tup_read), 0) FROM pg_stat_user_tables)"
                    " + (SELECT coalesce(sum(idx_tup_read), 0) FROM pg_stat_user_indexes)"
                )
            )
        )


@pytest.fixture
def own_database(service_env: dict[str, str]) -> Iterator[Settings]:
    """Settings on a database of this test's own (migrated to head): PostgreSQL's read counts
    of a database are only this test's when no other test's connection can report into them."""
    for url in fresh_database("deferral_cost"):
        yield load_settings({**service_env, "DEFERRAL_DATABASE_URL": url}, Path("/nonexistent"))


def test_one_change_in_a_run_costs_the_same_in_a_run_of_10_or_10000_tasks(
    own_database: Settings, cipher: Cipher, write_dag: Callable[[str, str], Any]
) -> None:
    """One loop that evaluates a run just marked by a success and applies one fired event of
    that run (resumed and queued in that loop): the same statements, and no more rows read by
    PostgreSQL, in a run of 10,000 tasks as in a run of 10."""
    settings = own_database
    sessions = make_sessionmaker(make_engine(settings.database_url))
    sizes = {"cost_small": 10, "cost_big": 10_000}
    triggers = {}
    for dag_id, size in sizes.items():
        write_dag(dag_id, SIZED_DAG.format(dag_id=dag_id, size=size))
        triggers[dag_id] = _sized_run(sessions, dag_id, size)
    with sessions.begin() as session:  # as autovacuum leaves a table of 10,000 new rows
        session.execute(text("ANALYZE"))
    service = _loop_service(settings)  # the first look at each run: checked against its DAG
    stats = create_engine(settings.database_url, poolclass=NullPool)
    costs = {}
    for dag_id in sizes:
        with sessions.begin() as session:  # another success in the run marks it
            session.execute(
                text("UPDATE dag_run SET evaluate_after = now() WHERE dag_id = :d"), {"d": dag_id}
            )
        service.broker.publish(
            service.keys.events, event_message(cipher, triggers[dag_id], dag_id, "triggerer")
        )
        _quiet([service.engine, sessions.kw["bind"]], stats)
        before = _tuples_read(stats)
        _none_due(service)  # none of the periodic work is due in this loop
        statements = _statements_of(service, service.step)
        _quiet([service.engine, sessions.kw["bind"]], stats)
        costs[dag_id] = (len(statements), _tuples_read(stats) - before)
        with sessions() as session:
            states = dict(
                session.execute(
                    text(
                        "SELECT task_id, state FROM task_instance"
                        " WHERE dag_id = :d AND task_id IN ('t1', 't2')"
                    ),
                    {"d": dag_id},
                ).all()
            )
            marked = session.scalar(
                text("SELECT evaluate_after FROM dag_run WHERE dag_id = :d"), {"d": dag_id}
            )
        assert states == {"t1": "queued", "t2": "deferred"}, dag_id  # resumed, queued
        assert marked is None, dag_id  # evaluated in that loop
    stats.dispose()
    sessions.kw["bind"].dispose()
    service.engine.dispose()
    service.broker.close()

    (small_statements, small_reads), (big_statements, big_reads) = costs.values()
    said = f"10 tasks: {costs['cost_small']}, 10,000 tasks: {costs['cost_big']} (statements, rows)"
    assert 0 < small_statements < 40, said
    assert big_statements == small_statements, said
    # A plan may differ between a table of 10 and one of 10,000 rows (a sequential scan of a
    # few rows where an index is taken later), never by a read that grows with the run.
    assert big_reads <= small_reads + 20, said


# -- no pass reads all waiters (scheduler/DECISIONS.md 27) ---------------------------------------

WAITING_DAG = """
from deferral import DAG
from deferral.operators import EmptyOperator

with DAG("waiting", max_active_runs=1_000_000) as dag:
    EmptyOperator(task_id="wait")
"""


def _waiting_runs(sessions: sessionmaker[Session], first: int, count: int) -> None:
    """``count`` running runs of DAG ``waiting``, each with its task deferred (an hour ago,
    a month ahead) on a trigger of its own (every other one shared), as a catch-up leaves
    them once all are deferred."""
    with sessions.begin() as session:
        session.execute(
            text(
                """
                WITH runs AS (
                    INSERT INTO dag_run (dag_id, run_id, logical_date, state, start_date)
                    SELECT 'waiting', 'w_' || n, now() - interval '1 year' + n * interval '1 s',
                           'running', now() - interval '1 hour'
                    FROM generate_series(:first, :first + :count - 1) AS n
                    RETURNING run_id
                ), triggers AS (
                    INSERT INTO trigger (classpath, kwargs, share_key)
                    SELECT 'deferral.triggers.temporal.DateTimeTrigger', run_id,
                           CASE WHEN right(run_id, 1) IN ('0', '2', '4', '6', '8')
                                THEN md5(run_id) END
                    FROM runs
                    RETURNING id, kwargs AS run_id
                )
                INSERT INTO task_instance (dag_id, run_id, task_id, state, try_number, trigger_id,
                                           next_method, trigger_timeout, updated_at)
                SELECT 'waiting', run_id, 'wait', 'deferred', 1, id, 'resume',
                       now() + interval '30 days', now() - interval '1 hour'
                FROM triggers
                """
            ),
            {"first": first, "count": count},
        )


def _one_of_each_pass(service: SchedulerService, sessions: sessionmaker[Session], n: int) -> None:
    """A queued run of the waiting DAG to start, then one loop with every periodic pass due."""
    with sessions.begin() as session:
        session.execute(
            text(
                "INSERT INTO dag_run (dag_id, run_id, logical_date, state, evaluate_after)"
                " VALUES ('waiting', :run_id, now(), 'queued', now())"
            ),
            {"run_id": f"new_{n}"},
        )
    for periodic in service.periodic:
        periodic.due = 0.0
    service.step()
    _none_due(service)
    service.step()  # what the first loop's evaluation scheduled is queued by now or here


def test_no_pass_reads_the_waiting_runs(
    own_database: Settings,
    write_dag: Callable[[str, str], Any],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """One loop with every periodic pass due, starting one queued run and queueing its task,
    with 10 and with 100,000 runs waiting on deferred tasks: the same statements, and no more
    rows read by PostgreSQL but for the paged sweeps' pages. The waiting rows are bulk-loaded
    after the statistics were taken with 10, then analyzed as the scheduler's statistics pass
    does after bulk changes."""
    settings = own_database
    monkeypatch.setattr(scheduler_service, "EVENT_BLOCK_MS", 1)  # no event comes
    monkeypatch.setattr(housekeeping, "UNWAITED_PAGE", 20)
    write_dag("waiting", WAITING_DAG)
    sessions = make_sessionmaker(make_engine(settings.database_url))
    _waiting_runs(sessions, first=1, count=10)
    with sessions.begin() as session:
        session.execute(text("ANALYZE"))
    service = _loop_service(settings)
    service.reconciler.page = 20
    stats = create_engine(settings.database_url, poolclass=NullPool)
    costs = {}
    for size, more in ((10, 0), (100_000, 99_990)):
        if more:
            _waiting_runs(sessions, first=11, count=more)
            # What the first start pass after bulk changes does once (the 99,990 runs' counts
            # folded), and the scheduler's statistics pass in its next loops.
            with sessions.begin() as session:
                session.execute(text("SELECT 1 FROM dag WHERE dag_id = 'waiting' FOR UPDATE"))
                dagruns.fold_counts(session, ["waiting"])
            _quiet([service.engine, sessions.kw["bind"]], stats)  # the changes' counts in
            while statistics.analyze_changed(sessions) is not None:
                pass
            assert statistics.vacuum_counts(service.engine)
        _quiet([service.engine, sessions.kw["bind"]], stats)
        before = _tuples_read(stats)
        statements = _statements_of(service, lambda n=size: _one_of_each_pass(service, sessions, n))
        _quiet([service.engine, sessions.kw["bind"]], stats)
        costs[size] = (len(statements), _tuples_read(stats) - before)
        with sessions() as session:
            state = session.scalar(
                text("SELECT state FROM task_instance WHERE run_id = :r"), {"r": f"new_{size}"}
            )
        assert state == "queued", size  # started, evaluated and queued in those loops
        with sessions.begin() as session:  # done, as a worker would have it by the next size
            session.execute(
                text("UPDATE task_instance SET state = 'success' WHERE run_id LIKE 'new_%'")
            )
    stats.dispose()
    sessions.kw["bind"].dispose()
    service.engine.dispose()
    service.broker.close()

    said = f"10 waiting: {costs[10]}, 100,000 waiting: {costs[100_000]} (statements, rows)"
    assert costs[100_000][0] == costs[10][0], said
    # The two sweeps read a page each (20 rows, 2 reads each: index and table) where they read
    # 10; a plan may differ between small and big tables by a few rows.
    assert costs[100_000][1] <= costs[10][1] + 200, said


def test_queued_runs_start_in_batches_whatever_their_number(
    settings: Settings, sessions: sessionmaker[Session], write_dag: Callable[[str, str], Any]
) -> None:
    """One start pass starts up to START_BATCH queued runs in the same statements as one:
    5 or 500 queued runs (with 100 running), 500 started by one pass, in its statements;
    fewer while started runs wait for their evaluation."""
    write_dag("waiting", WAITING_DAG)
    _waiting_runs(sessions, first=1, count=100)
    service = _loop_service(settings)
    counts = {}
    for queued in (5, scheduler_service.START_BATCH):
        with sessions.begin() as session:
            session.execute(
                text(
                    "INSERT INTO dag_run (dag_id, run_id, logical_date, state)"
                    " SELECT 'waiting', 'q' || :queued || '_' || n, now() + n * interval '1 s',"
                    " 'queued' FROM generate_series(1, :queued) AS n"
                ),
                {"queued": queued},
            )
        counts[queued] = len(_statements_of(service, service.start_queued_runs))
        with sessions.begin() as session:  # evaluated, as the loops after it do
            session.execute(text("UPDATE dag_run SET evaluate_after = NULL"))
        with sessions() as session:
            left = session.scalar(text("SELECT count(*) FROM dag_run WHERE state = 'queued'"))
            tasks = session.scalar(
                text("SELECT count(*) FROM task_instance WHERE run_id LIKE :q"),
                {"q": f"q{queued}_%"},
            )
        assert (left, tasks) == (0, queued)
    with sessions.begin() as session:  # 100 started runs not evaluated yet: 400 start
        session.execute(
            text(
                "INSERT INTO dag_run (dag_id, run_id, logical_date, state, evaluate_after)"
                " SELECT 'waiting', 'm' || n, now() - n * interval '1 s', 'running', now()"
                " FROM generate_series(1, 100) AS n;"
                " INSERT INTO dag_run (dag_id, run_id, logical_date, state)"
                " SELECT 'waiting', 'l' || n, now() + interval '1 day' + n * interval '1 s',"
                " 'queued' FROM generate_series(1, 500) AS n"
            )
        )
    service.start_queued_runs()
    with sessions() as session:
        left = session.scalar(text("SELECT count(*) FROM dag_run WHERE state = 'queued'"))
    service.broker.close()
    assert counts[5] == counts[scheduler_service.START_BATCH], counts
    assert left == 100


def test_marked_runs_are_evaluated_together_in_the_statements_of_one(
    settings: Settings, sessions: sessionmaker[Session], write_dag: Callable[[str, str], Any]
) -> None:
    """Runs started and marked (a caught-up schedule) are evaluated together: one evaluation
    pass over 1 or MARKED_BATCH of them runs the same statements, schedules the task of each
    and queues what the pool lets through (before, about seven statements a run)."""
    write_dag("waiting", WAITING_DAG)
    service = _loop_service(settings)
    counts = {}
    for queued in (1, evaluation.MARKED_BATCH):
        with sessions.begin() as session:
            session.execute(
                text(
                    "INSERT INTO dag_run (dag_id, run_id, logical_date, state)"
                    " SELECT 'waiting', 'e' || :queued || '_' || n, now() + n * interval '1 s',"
                    " 'queued' FROM generate_series(1, :queued) AS n"
                ),
                {"queued": queued},
            )
        service.start_queued_runs()
        counts[queued] = len(_statements_of(service, service.evaluate_marked_runs))
        with sessions() as session:
            states = session.execute(
                text(
                    "SELECT t.state, count(*) FROM task_instance AS t JOIN dag_run AS r"
                    " USING (dag_id, run_id) WHERE r.run_id LIKE :e"
                    " AND r.evaluate_after IS NULL AND r.scheduling_error IS NULL"
                    " GROUP BY t.state"
                ),
                {"e": f"e{queued}_%"},
            ).all()
        found = dict(states)  # queued as far as the default pool's 128 slots let them
        assert found.get("queued") == min(queued, 128)
        assert found.get("queued", 0) + found.get("scheduled", 0) == queued
        with sessions.begin() as session:  # as if they ran and deferred
            session.execute(text("UPDATE task_instance SET state = 'deferred'"))
    service.broker.close()
    assert counts[1] == counts[evaluation.MARKED_BATCH], counts
