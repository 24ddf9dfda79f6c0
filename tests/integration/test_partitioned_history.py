"""The history tables are partitioned by day: retention drops old days whole (no row deleted)
and keeps what unfinished runs need; the scheduler makes partitions ahead; migration 0014
converts a database holding data and downgrades."""

from __future__ import annotations

import datetime as dt
import re
from collections.abc import Iterator

from alembic import command
from click.testing import CliRunner
from sqlalchemy import create_engine, text, update
from sqlalchemy.orm import Session, sessionmaker

from deferral.runtime.config import Settings
from deferral.store import migrate, partitions
from deferral.store.tables import DagRun
from deferral.store.transitions import deferrals
from deferral_cli import main as deferral_main
from scheduler.service import SchedulerService
from tests.conftest import fresh_database
from tests.helpers import wait_for

HISTORY = ("task_state_change", "task_log", "resume_event")


def _today(session: Session) -> dt.datetime:
    day = session.scalar(text("SELECT date_trunc('day', now(), 'UTC')"))
    assert day is not None
    return day


def _days_back(sessions: sessionmaker[Session], days: int) -> dt.datetime:
    """Replace the partition made of the tables before 0014 with one partition per day for the
    last ``days`` days (and today's), if not there yet; returns the start of today (UTC)."""
    with sessions.begin() as session:
        today = _today(session)
        for table in HISTORY:
            for name in partitions.catch_alls(session, table)[1:]:
                session.execute(text(f"ALTER TABLE {table} DETACH PARTITION {name}"))
                session.execute(text(f"DROP TABLE {name}"))
            made = partitions.partitions(session, table)
            for back in range(days, 0, -1):
                day = (today - dt.timedelta(days=back)).date()
                if partitions.day_partition(table, day) in made:
                    continue  # by an earlier test of the session
                session.execute(
                    text(
                        f"CREATE TABLE {partitions.day_partition(table, day)} PARTITION OF"
                        f" {table} FOR VALUES FROM ('{day} 00:00+00')"
                        f" TO ('{day + dt.timedelta(days=1)} 00:00+00')"
                    )
                )
    partitions.make_ahead(sessions)
    return today


def _run(
    sessions: sessionmaker[Session],
    run_id: str,
    times: list[dt.datetime],
    ended: dt.datetime | None,
) -> int:
    """A run whose task has a state change, a log line and a resume event at each of ``times``;
    finished at ``ended`` (None: still running)."""
    with sessions.begin() as session:
        # Plain statements: the database may be at an older revision than the models (0013,
        # before the columns later migrations add).
        session.execute(
            text(
                "INSERT INTO dag_run (dag_id, run_id, run_type, logical_date, state, conf,"
                " start_date) VALUES (:r, :r, 'manual', :at, 'running', '{}', :at)"
            ),
            {"r": run_id, "at": times[0]},
        )
        ti_id = session.scalar(
            text(
                "INSERT INTO task_instance (dag_id, run_id, task_id, map_index, max_tries, pool,"
                " pool_slots, queue, priority_weight) VALUES (:r, :r, 't', -1, 0,"
                " 'default_pool', 1, 'default', 1) RETURNING id"
            ),
            {"r": run_id},
        )
        for n, at in enumerate(times):
            values = {"ti": ti_id, "at": at, "key": f"{run_id}-{n}"}
            session.execute(
                text(
                    "INSERT INTO task_state_change (task_instance_id, from_state, to_state, at)"
                    " VALUES (:ti, 'scheduled', 'queued', :at)"
                ),
                values,
            )
            session.execute(
                text(
                    "INSERT INTO task_log (task_instance_id, try_number, at, source, text)"
                    " VALUES (:ti, 1, :at, 'task', 'line')"
                ),
                values,
            )
            session.execute(
                text(
                    "INSERT INTO resume_event (dedup_key, trigger_id, task_instance_id, outcome,"
                    " received_at) VALUES (:key, 1, :ti, 'applied', :at)"
                ),
                values,
            )
        if ended is not None:
            session.execute(
                update(DagRun)
                .where(DagRun.run_id == run_id)
                .values(state="success", end_date=ended)
            )
    assert ti_id is not None
    return int(ti_id)


def _history(sessions: sessionmaker[Session], ti_id: int) -> dict[str, int]:
    with sessions() as session:
        return {
            table: int(
                session.scalar(
                    text(f"SELECT count(*) FROM {table} WHERE task_instance_id = :ti"),
                    {"ti": ti_id},
                )
                or 0
            )
            for table in HISTORY
        }


def _deleted(sessions: sessionmaker[Session], tables: tuple[str, ...]) -> dict[str, int]:
    """n_tup_del of each of ``tables`` and their partitions (as the statistics last flushed)."""
    with sessions() as session:
        session.execute(text("SELECT pg_stat_clear_snapshot()"))
        rows = session.execute(
            text(
                """SELECT relname, n_tup_del FROM pg_stat_user_tables
                WHERE relname LIKE ANY (CAST(:patterns AS text[]))"""
            ),
            {"patterns": [f"{t}%" for t in tables]},
        )
        return {name: int(count) for name, count in rows if not name.startswith("task_log_try")}


def test_prune_drops_old_days_whole_and_keeps_what_unfinished_runs_need(
    settings: Settings, sessions: sessionmaker[Session]
) -> None:
    today = _days_back(sessions, 3)
    noon = [today - dt.timedelta(days=back, hours=-12) for back in (3, 2, 1, 0)]
    # Three days of runs: one finished the day before yesterday (its history goes), one that
    # ran from three days ago until yesterday (finished within the retention: its history stays),
    # one still running since three days ago (it stays whole).
    old = _run(sessions, "old", noon[:2], ended=noon[1])
    recent = _run(sessions, "recent", noon[:3], ended=noon[2])
    running = _run(sessions, "running", noon, ended=None)
    deletes_before = _deleted(sessions, (*HISTORY, "task_instance"))
    # The resume path's dedup look-up reads only the last day's partitions: not the older
    # ones, nor the default one, nor those made ahead.
    with sessions() as session:
        plan = "\n".join(
            session.scalars(
                text(f"EXPLAIN (ANALYZE, COSTS OFF) {deferrals._CLAIM_EVENTS_SQL.text}"),
                {
                    "dedup_keys": ["k"],
                    "trigger_ids": [1],
                    "events": [None],
                    "reasons": [None],
                    "dedup_window": deferrals.DEDUP_WINDOW,
                },
            )
        )
        session.rollback()
    scanned = set(re.findall(r" on (resume_event_\w+)", plan))
    assert scanned == {partitions.day_partition("resume_event", d.date()) for d in noon[2:]}

    result = CliRunner().invoke(deferral_main, ["db", "prune", "--older-than", "1d"])

    assert result.exit_code == 0, result.output
    # Three days ago and the day before yesterday, of each table.
    assert "6 history partition(s) dropped" in result.output
    assert "1 run(s) with 1 task instance(s)" in result.output
    assert _history(sessions, old) == dict.fromkeys(HISTORY, 0)
    # A finished run needs no dedup key: only its resume event of yesterday stays.
    assert _history(sessions, recent) == {"task_state_change": 3, "task_log": 3, "resume_event": 1}
    assert _history(sessions, running) == dict.fromkeys(HISTORY, 4)
    with sessions() as session:
        left = {t: sorted(partitions.partitions(session, t)) for t in HISTORY}
    for table in HISTORY:
        first = partitions.day_partition(table, noon[2].date())
        assert left[table][0] == first, left[table]
    # Once the statistics show the pruned run's task instance deleted, they show no row of
    # the history tables deleted: the old days went as whole partitions.
    wait_for(
        lambda: (
            _deleted(sessions, ("task_instance",))["task_instance"]
            > deletes_before["task_instance"]
        ),
        what="the prune's statistics",
    )
    after = _deleted(sessions, HISTORY)
    assert after, "no statistics"
    assert {name: after[name] - deletes_before.get(name, 0) for name in after} == dict.fromkeys(
        after, 0
    )


def test_partitions_are_made_ahead_once_whoever_asks(
    settings: Settings, sessions: sessionmaker[Session]
) -> None:
    partitions.make_ahead(sessions)
    assert partitions.make_ahead(sessions) == []
    with sessions() as session:
        today = _today(session).date()
        last = max(end for _, end in partitions.partitions(session, "task_log").values()).date()
        assert last > today + dt.timedelta(days=partitions.AHEAD_DAYS)
        days = (last - today).days  # one day more than there are
        # While another scheduler holds the lock, nothing is made (and nothing waits).
        session.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": partitions.LOCK_KEY})
        assert partitions.make_ahead(sessions, days=days) == []
    made = partitions.make_ahead(sessions, days=days)
    assert made == [partitions.day_partition(t, last) for t in HISTORY]


def _database_at_0013() -> Iterator[str]:
    return fresh_database("deferral_test_0014")


def test_migration_converts_a_database_holding_data_and_downgrades(settings: Settings) -> None:
    databases = _database_at_0013()
    url = next(databases)
    config = migrate.alembic_config(url)
    try:
        command.downgrade(config, "0013")
        engine = create_engine(url)
        sessions = sessionmaker(engine)
        long_ago = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
        # A row stamped by a writer's clock a month ahead, past the days 0014 makes.
        ahead = dt.datetime.now(dt.UTC) + dt.timedelta(days=30)
        ti_id = _run(sessions, "before", [long_ago, ahead], None)

        command.upgrade(config, "head")

        assert _history(sessions, ti_id) == dict.fromkeys(HISTORY, 2)
        with sessions.begin() as session:
            for table in HISTORY:
                ranges = partitions.partitions(session, table)
                assert [n for n, (low, _) in ranges.items() if low is None], ranges
                assert session.scalar(text(f"SELECT count(*) FROM {table}_default")) == 1
            # New rows take ids after the old ones and go to today's partition.
            new_id = session.scalar(
                text(
                    "INSERT INTO task_state_change (task_instance_id, from_state, to_state)"
                    " VALUES (:ti, 'queued', 'running') RETURNING id"
                ),
                {"ti": ti_id},
            )
            assert new_id == 3
        command.downgrade(config, "0013")

        assert _history(sessions, ti_id) == {
            "task_state_change": 3,
            "task_log": 2,
            "resume_event": 2,
        }
        with sessions.begin() as session:
            kind = session.scalar(
                text("SELECT relkind FROM pg_class WHERE relname = 'task_state_change'")
            )
            assert kind == "r"
            next_id = session.scalar(
                text(
                    "INSERT INTO task_state_change (task_instance_id, from_state, to_state)"
                    " VALUES (:ti, 'running', 'success') RETURNING id"
                ),
                {"ti": ti_id},
            )
            assert next_id is not None and next_id > 3
        engine.dispose()
    finally:
        databases.close()


def test_a_day_made_late_takes_over_its_rows_from_the_default_partition(
    settings: Settings, sessions: sessionmaker[Session]
) -> None:
    with sessions() as session:
        last = max(end for _, end in partitions.partitions(session, "task_log").values())
    ti_id = _run(sessions, "ahead", [last + dt.timedelta(hours=1)], ended=None)
    with sessions() as session:
        in_default = session.scalar(text("SELECT count(*) FROM task_log_default"))
    assert in_default == 1  # a writer's clock past the days made

    days = (last.date() - dt.datetime.now(dt.UTC).date()).days
    partitions.make_ahead(sessions, days=days)

    with sessions() as session:
        assert session.scalar(text("SELECT count(*) FROM task_log_default")) == 0
        moved = session.scalar(
            text(f"SELECT count(*) FROM {partitions.day_partition('task_log', last.date())}")
        )
    assert moved == 1
    assert _history(sessions, ti_id) == dict.fromkeys(HISTORY, 1)


def test_the_scheduler_makes_the_days_ahead_in_its_loop(
    settings: Settings, sessions: sessionmaker[Session]
) -> None:
    with sessions.begin() as session:
        day = _today(session).date() + dt.timedelta(days=partitions.AHEAD_DAYS)
        for table in HISTORY:
            name = partitions.day_partition(table, day)
            session.execute(text(f"ALTER TABLE {table} DETACH PARTITION {name}"))
            session.execute(text(f"DROP TABLE {name}"))
    service = SchedulerService(settings, name="s")
    made = service.housekeeping.make_partitions
    assert [every.interval for every in service.periodic if every.step == made]

    service.housekeeping.make_partitions()

    with sessions() as session:
        for table in HISTORY:
            assert partitions.day_partition(table, day) in partitions.partitions(session, table)


def test_a_long_reader_makes_retention_wait_for_its_next_pass_not_fail(
    settings: Settings, sessions: sessionmaker[Session]
) -> None:
    _days_back(sessions, 2)
    prune = ["db", "prune", "--older-than", "1d"]
    with sessions() as reader:
        reader.execute(text("SELECT 1 FROM task_state_change LIMIT 1"))  # holds it until closed

        waited = CliRunner().invoke(deferral_main, prune)

    assert waited.exit_code == 0, waited.output
    assert "0 history partition(s) dropped" in waited.output
    done = CliRunner().invoke(deferral_main, prune)
    assert "3 history partition(s) dropped" in done.output, done.output
