"""The read model's keyset pages: a first page of N says there is more, the next page follows
its cursor, rows added while a reader pages neither repeat nor hide rows, a cursor no page gave
is refused naming it, and a first page (the Deferred page's, the CLI's) reads about N rows of
20,000 through an index."""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Callable
from typing import Any

import pytest
from click.testing import CliRunner
from sqlalchemy import event, text
from sqlalchemy.orm import Session, sessionmaker
from starlette.testclient import TestClient

from deferral.runtime.config import Settings
from deferral.store.tables import DagRun
from deferral_cli import main as deferral_main
from readmodel import pages
from readmodel.pages import BadCursor, Page
from readmodel.runs import run_list
from readmodel.tasks import task_list
from readmodel.triggers import trigger_list
from readmodel.waits import deferred_now, deferred_page_query

TRIGGER = "deferral.triggers.temporal.DateTimeTrigger"


def _seed_deferred(sessions: sessionmaker[Session], n: int, dag_id: str = "paged") -> None:
    """``n`` task instances deferred on a trigger each (raw rows: thousands in a second)."""
    with sessions.begin() as session:
        session.execute(
            text(
                "WITH made AS (INSERT INTO trigger (classpath, kwargs)"
                " SELECT :classpath, 'sealed' FROM generate_series(1, :n) RETURNING id)"
                " INSERT INTO task_instance (dag_id, run_id, task_id, state, try_number,"
                " trigger_id) SELECT :dag_id, 'r', 't' || id, 'deferred', 1, id FROM made"
            ),
            {"classpath": TRIGGER, "n": n, "dag_id": dag_id},
        )


def _every_page(read: Callable[[str | None], Page], between: Callable[[], None]) -> list[Any]:
    """The rows of every page from the first, ``between`` called after each page."""
    rows: list[Any] = []
    after: str | None = None
    while True:
        page = read(after)
        rows += page.rows
        between()
        if page.after is None:
            return rows
        assert page.more and page.rows
        after = page.after


def test_task_pages_follow_their_cursor_without_overlap_or_gap_while_rows_are_added(
    sessions: sessionmaker[Session],
) -> None:
    _seed_deferred(sessions, 7)
    with sessions() as session:
        everything = task_list(session, limit=100, dag_id="paged")
        first = task_list(session, limit=3, dag_id="paged")
    assert everything.after is None and len(everything.rows) == 7
    assert first.more and first.rows == everything.rows[:3]

    def read(after: str | None) -> Page:
        with sessions() as session:
            return task_list(session, limit=3, after=after, dag_id="paged", state="deferred")

    # Newest first: what is added while paging is newer than every page already read.
    listed = _every_page(read, lambda: _seed_deferred(sessions, 2))
    assert listed[:3] == first.rows and listed == everything.rows


def test_trigger_pages_add_what_is_created_while_paging_at_the_end(
    sessions: sessionmaker[Session],
) -> None:
    _seed_deferred(sessions, 5)
    with sessions() as session:
        before = trigger_list(session, limit=100).rows
    added = 0

    def add() -> None:
        nonlocal added
        if added < 4:
            _seed_deferred(sessions, 2, dag_id=f"later{added}")
            added += 2

    def read(after: str | None) -> Page:
        with sessions() as session:
            return trigger_list(session, limit=2, after=after)

    listed = _every_page(read, add)
    ids = [row["id"] for row in listed]
    assert ids == sorted(set(ids)) and len(ids) == len(before) + added
    assert listed[: len(before)] == before
    assert all(len(row["waiting_tasks"]) == 1 for row in listed)


def test_run_pages_go_from_the_newest_logical_date(sessions: sessionmaker[Session]) -> None:
    start = dt.datetime(2030, 1, 1, tzinfo=dt.UTC)
    with sessions.begin() as session:
        for day in range(5):
            session.add(
                DagRun(
                    dag_id="paged",
                    run_id=f"r{day}",
                    logical_date=start + dt.timedelta(days=day),
                    state="success",
                )
            )

    def read(after: str | None) -> Page:
        with sessions() as session:
            return run_list(session, limit=2, after=after, dag_id="paged")

    assert [r["run_id"] for r in _every_page(read, lambda: None)] == [
        "r4",
        "r3",
        "r2",
        "r1",
        "r0",
    ]


def test_deferred_pages_follow_the_order_tasks_deferred_in(
    settings: Settings, sessions: sessionmaker[Session]
) -> None:
    _seed_deferred(sessions, 5)
    seen: list[str] = []
    after = None
    with sessions() as session:
        for expected_more in (True, True, False):
            page = deferred_now(session, settings, limit=2, after=after)
            assert page["total"] == 5 and not page["total_capped"]
            assert (page["next_after"] is not None) == expected_more
            seen += [t["task_id"] for group in page["groups"] for t in group["tasks"]]
            after = page["next_after"]
    assert len(seen) == len(set(seen)) == 5
    assert seen == sorted(seen, key=lambda task_id: int(task_id[1:]))


@pytest.mark.parametrize(
    ("cursor", "kinds"),
    [
        ("", (int,)),
        ("12,13", (int,)),
        ("x", (int,)),
        ("2030-01-01", (dt.datetime, int)),
        ("yesterday,3", (dt.datetime, int)),
    ],
)
def test_a_cursor_no_page_gave_is_refused_naming_it(cursor: str, kinds: tuple[type, ...]) -> None:
    with pytest.raises(BadCursor, match="is not a cursor of this list"):
        pages.decode(cursor, *kinds)


def test_a_cursor_gives_back_the_key_it_was_made_of() -> None:
    key = (dt.datetime(2030, 1, 2, 3, 4, 5, 6, tzinfo=dt.UTC), 42)
    assert pages.decode(pages.encode(key), dt.datetime, int) == key


def test_cli_lists_say_there_is_more_and_take_the_cursor(
    settings: Settings, sessions: sessionmaker[Session]
) -> None:
    _seed_deferred(sessions, 3)
    first = CliRunner().invoke(deferral_main, ["tasks", "list", "--limit", "2", "--json"])
    assert first.exit_code == 0, first.output
    assert len(json.loads(first.stdout)) == 2
    assert first.stderr.startswith("more\u2026 (the next page: --after ")
    cursor = first.stderr.rsplit(" ", 1)[1].rstrip(")\n")
    rest = CliRunner().invoke(deferral_main, ["tasks", "list", "--limit", "2", "--after", cursor])
    assert rest.exit_code == 0 and rest.stderr == ""
    assert len(rest.stdout.splitlines()) == 2  # the header and the oldest task instance

    triggers = CliRunner().invoke(deferral_main, ["triggers", "list", "--limit", "1"])
    assert triggers.exit_code == 0 and "--after " in triggers.stderr

    bad = CliRunner().invoke(deferral_main, ["runs", "list", "--after", "nonsense"])
    assert bad.exit_code == 2
    assert "'--after'" in bad.output and "'nonsense' is not a cursor" in bad.output


def test_the_deferred_page_and_api_are_paged(
    local: TestClient, sessions: sessionmaker[Session]
) -> None:
    _seed_deferred(sessions, 3)
    first = local.get("/api/v1/deferred", params={"limit": 2}).json()
    assert first["listed"] == 2 and first["total"] == 3 and first["next_after"]
    rest = local.get("/api/v1/deferred", params={"after": first["next_after"]}).json()
    assert rest["listed"] == 1 and rest["next_after"] is None
    page = local.get("/deferred", params={"limit": 2}).text
    assert 'id="deferred-more"' in page and "more\u2026" in page
    bad = local.get("/api/v1/deferred", params={"after": "nonsense"})
    assert bad.status_code == 400 and "'nonsense' is not a cursor" in bad.json()["error"]


def _plan_nodes(plan: dict[str, Any]) -> list[dict[str, Any]]:
    return [plan, *(node for child in plan.get("Plans", []) for node in _plan_nodes(child))]


def test_the_first_pages_of_many_read_about_a_page_of_rows(
    sessions: sessionmaker[Session], settings: Settings
) -> None:
    _seed_deferred(sessions, 20_000)
    with sessions() as session:
        session.execute(text("ANALYZE task_instance"))
        session.execute(text("ANALYZE trigger"))
        compiled = deferred_page_query(50, None).compile(dialect=session.get_bind().dialect)
        ((explained,),) = (
            session.connection()
            .exec_driver_sql(f"EXPLAIN (ANALYZE, FORMAT JSON) {compiled}", compiled.params)
            .all()
        )
        nodes = _plan_nodes(explained[0]["Plan"])
        on_task_instance = [n for n in nodes if n.get("Relation Name") == "task_instance"]
        assert [n["Index Name"] for n in on_task_instance] == ["ix_task_instance_deferred_order"]
        assert on_task_instance[0]["Actual Rows"] <= 51
        assert not any(n["Node Type"] == "Seq Scan" for n in nodes)

        # The CLI's and the API's lists: every statement of a first page scans an index and
        # reads at most a page and one row of each table.
        for read in (
            lambda: task_list(session, limit=50, state="deferred"),
            lambda: task_list(session, limit=50, dag_id="paged"),
            lambda: trigger_list(session, limit=50),
        ):
            statements = _statements_of(session, read)
            assert statements
            for statement, params in statements:
                ((plan,),) = (
                    session.connection()
                    .exec_driver_sql(f"EXPLAIN (ANALYZE, FORMAT JSON) {statement}", params)
                    .all()
                )
                scans = [n for n in _plan_nodes(plan[0]["Plan"]) if "Relation Name" in n]
                assert scans and all("Index" in n["Node Type"] for n in scans), statement
                assert all(n["Actual Rows"] * n["Actual Loops"] <= 51 for n in scans), statement


def _statements_of(session: Session, read: Callable[[], Any]) -> list[tuple[str, Any]]:
    """The SELECTs ``read`` sends, with their parameters."""
    sent: list[tuple[str, Any]] = []

    def record(conn: Any, cursor: Any, statement: str, params: Any, *_: Any) -> None:
        if statement.lstrip().upper().startswith("SELECT"):
            sent.append((statement, params))

    engine = session.get_bind()
    event.listen(engine, "before_cursor_execute", record)
    try:
        read()
    finally:
        event.remove(engine, "before_cursor_execute", record)
    return sent


def test_the_api_lists_runs_task_instances_and_triggers_a_page_at_a_time(
    local: TestClient, sessions: sessionmaker[Session]
) -> None:
    _seed_deferred(sessions, 3)
    first = local.get("/api/v1/task_instances", params={"limit": 2, "state": "deferred"}).json()
    assert len(first["task_instances"]) == 2 and first["next_after"]
    rest = local.get("/api/v1/task_instances", params={"after": first["next_after"]}).json()
    listed = [int(t["task_id"][1:]) for t in first["task_instances"] + rest["task_instances"]]
    assert listed == sorted(set(listed), reverse=True) and len(listed) == 3
    assert rest["next_after"] is None
    triggers = local.get("/api/v1/triggers", params={"limit": 1}).json()
    assert len(triggers["triggers"]) == 1 and triggers["triggers"][0]["waiting_tasks"]
    assert local.get("/api/v1/runs").json() == {"runs": [], "next_after": None}
    bogus = local.get("/api/v1/runs", params={"state": "sleeping"})
    assert bogus.status_code == 400 and "state must be one of" in bogus.json()["error"]
    too_many = local.get("/api/v1/triggers", params={"limit": 10**9})
    assert too_many.status_code == 400 and "limit must be between" in too_many.json()["error"]
